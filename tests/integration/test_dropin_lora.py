"""LoRA and the pool (patch 0074): a sharer gets the pool's cells only if the same adapter scales computed them.

There is no adapter for the default model, so the test writes one: a rank-4 LoRA on every layer's K and V
projections (it changes the KV cells themselves), small random weights, saved with the ``gguf`` package.
The hole it closes: before 0074 the check compared the sharer's adapters with the pool slot's *last task*,
so changing the scales and re-sending the pool's prompt could hand a sharer cells computed under other scales.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from polykv_py.client import Client, Share
from polykv_py.data import sample_document
from polykv_py.harness.lora import write_adapter
from polykv_py.harness.texts import cut_to_tokens
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import pool_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    adapter = write_adapter(tmp_path_factory.mktemp("lora") / "kv-lora.gguf")
    srv = pool_server(model=model_path, n_agents_parallel=2, ctx=2048, threads=1, track_kv=False, name="lora",
                      extra_args=["--lora", str(adapter), "--lora-init-without-apply"])  # fmt: skip
    with srv:
        yield srv


def _scale(s: float) -> list[dict[str, float]]:
    return [{"id": 0, "scale": s}]


def test_a_sharer_never_gets_cells_computed_under_other_lora_scales(server: LlamaServer) -> None:
    c: Client = server.client
    base = cut_to_tokens(sample_document(), 300, c.tokenize, c.detokenize)
    prompt = base + "\n\nQuestion: How many docking stations are there?\nAnswer:"
    c.completion(base, id_slot=0, n_predict=1, lora=_scale(0.0))  # the pool, computed with the adapter off

    def share(scale: float) -> dict:
        c.erase_slot(1)
        return c.completion(prompt, id_slot=1, n_predict=8, temperature=0.0, share=Share(0), lora=_scale(scale))

    on = share(1.0)
    assert on["shared_prefix"]["status"] == "unsupported", on["shared_prefix"]
    assert "lora" in on["shared_prefix"]["reason"]
    c.erase_slot(1)
    alone = c.completion(prompt, id_slot=1, n_predict=8, temperature=0.0, lora=_scale(1.0))
    assert on["content"] == alone["content"]  # refused, so computed like a request that never asked to share
    off = share(0.0)
    assert off["shared_prefix"]["status"] == "hit"  # the scales that computed the pool

    # the hole: change the scales and re-send the pool's prompt to the pool slot; the pool must recompute
    # its cells under the new scales (not keep the old cells and take the new scales' name)
    c.post_json("/lora-adapters", [{"id": 0, "scale": 1.0}])  # type: ignore[arg-type]  # a list body
    c.completion(base, id_slot=0, n_predict=1, lora=_scale(1.0))
    on_again = share(1.0)
    assert on_again["shared_prefix"]["status"] == "hit", on_again["shared_prefix"]
    assert on_again["content"] == alone["content"]
    off_again = share(0.0)
    assert off_again["shared_prefix"]["status"] == "unsupported", off_again["shared_prefix"]

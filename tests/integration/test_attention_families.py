"""Attention variants the pinned models lack: Qwen3-style QK-norm GQA, and gpt-oss's attention sinks with SWA.

Two random-weight models written by :mod:`tiny_models` (docs/models.md): ``qwen3`` (2 layers, GQA 4/2, head size
32, RMS norm on Q and K per head) and ``gpt-oss`` (4 layers alternating a 128-token sliding window and full
attention, a learned sink logit per head, a 4-expert MoE). QK-norm is applied before K is stored, so shared cells
are the cells the sharer would compute; a sink adds one logit per head to every softmax, which the shared-decode
kernel (``native/ggml-cpu/polykv-fattn.cpp``) adds when it merges a row's chunks.

- a pool shares its full prompt and a shorter prefix (``hit``), the task computes only the rest and answers as
  the pristine reference server does computing the whole prompt; a pool file restored shares again;
- gpt-oss: a pool whose sliding-window layers reused the window of a shorter prefix refuses it (``swa_window``);
- ``--shared-decode`` runs on both (one op per layer and batch, shared tiles scored once: on gpt-oss in its
  sliding-window layers and with its sinks too) and the sharers' answers stay within the layout margins of the
  server without it (the kernel's sink arithmetic is checked against a double reference in
  tests/native/test_fattn_kernel.py);
- ``--share-any`` (``polykv serve``): concurrent plain ``openai`` chat agents over one system message, all but the
  first report ``cached_tokens`` >= the system message, the server computes at most the first prompt plus the
  others' suffixes (+5%), and the answers agree with the reference server's.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from pool_checks import assert_like_reference, outcomes, prime_pool, sharers_at_once
from tiny_models import GPT_OSS_SHAPE, QWEN3_SHAPE, write_gpt_oss, write_qwen3

from polykv_py.client import Share
from polykv_py.data import sample_document
from polykv_py.harness.answers import compare
from polykv_py.harness.compare import LAYOUT, compare_chat, compare_greedy
from polykv_py.harness.texts import cut_to_tokens
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import pool_server, reference_server, serve_server

pytestmark = pytest.mark.integration

CTX = 4096
GEN: dict[str, Any] = {"n_predict": 8, "temperature": 0, "n_probs": 2, "cache_prompt": True}
QUESTION = "\n\nQuestion: how many docking stations does the bike-share have?\nAnswer:"
#: name -> (writer, layers)
FAMILIES = {"qwen3": (write_qwen3, QWEN3_SHAPE["n_layer"]), "gpt-oss": (write_gpt_oss, GPT_OSS_SHAPE["n_layer"])}
N_SHARERS = 4
AGENTS = 4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def family_path(family: str, model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES[family][0](tmp_path_factory.mktemp("models") / f"tiny-{family}.gguf", model_path)


@pytest.fixture(scope="module")
def ref(family_path: Path, logs: Path) -> Iterator[LlamaServer]:
    name = f"{family_path.stem}-reference"
    with reference_server(model=family_path, n_slots=AGENTS, ctx=CTX, threads=2, log_dir=logs, name=name) as s:
        yield s


def small_pool_server(model: Path, logs: Path, name: str) -> LlamaServer:
    """A pool server with 2 agent slots and reserved pool 0 over ``model``."""
    return pool_server(model=model, n_agents_parallel=2, ctx=CTX, threads=2, track_kv=False, log_dir=logs,
                       name=f"{model.stem}-{name}")  # fmt: skip


def test_a_pool_shares_its_prompt_and_a_shorter_prefix(family_path: Path, ref: LlamaServer, logs: Path) -> None:
    with small_pool_server(family_path, logs, "pool") as srv:
        c = srv.client
        base = cut_to_tokens(sample_document(), 300, c.tokenize, c.detokenize)
        c.prime(base, 0)
        n_pool = len(c.prompt_tokens(base))
        for p in (n_pool, n_pool - 40):
            prompt = cut_to_tokens(base, p, c.tokenize, c.detokenize) + QUESTION
            n = c.shared_prefix_len(base, prompt)
            got = c.completion(prompt, share=Share(0), id_slot=1, **GEN)
            assert (got["shared_prefix"]["status"], got["shared_prefix"]["shared"]) == ("hit", n), got["shared_prefix"]
            assert n >= p - 1 and got["timings"]["prompt_n"] == len(c.prompt_tokens(prompt)) - n
            assert_like_reference(ref, prompt, got, GEN)
            c.erase_slot(1)


def test_a_pool_file_restores_and_shares(family_path: Path, ref: LlamaServer, logs: Path) -> None:
    with small_pool_server(family_path, logs, "files") as srv:
        c = srv.client
        base = cut_to_tokens(sample_document(), 300, c.tokenize, c.detokenize)
        n_pool = prime_pool(c, base)
        assert c.save_pool(0, "family.pkvpool")["n_saved"] == n_pool
        c.erase_slot(0)
        c.restore_pool(0, "family.pkvpool")
        (pool,) = c.pools()
        assert pool.resident and pool.n_tokens == n_pool and pool.restored_from == "family.pkvpool", pool
        prompt = base + QUESTION
        got = c.completion(prompt, share=Share(0), id_slot=1, **GEN)
        assert (got["shared_prefix"]["status"], got["shared_prefix"]["shared"]) == ("hit", n_pool), got["shared_prefix"]
        assert got["timings"]["prompt_n"] == len(c.prompt_tokens(prompt)) - n_pool
    assert_like_reference(ref, prompt, got, GEN)


def test_gpt_oss_refuses_a_prefix_whose_window_was_reused(
    model_path: Path, tmp_path_factory: pytest.TempPathFactory, logs: Path
) -> None:
    """gpt-oss's 128-token window: a pool of 1,500 tokens filled its sliding-window cache (about the window per
    slot and a batch), which reused the cells of its early positions; a share of its first 400 tokens needs
    positions 273-399 there: refused ``swa_window``, counted, nothing shared."""
    gpt_oss = write_gpt_oss(tmp_path_factory.mktemp("models") / "tiny-gpt-oss.gguf", model_path)
    with small_pool_server(gpt_oss, logs, "window") as srv:
        c = srv.client
        doc = sample_document()
        base = cut_to_tokens(doc, 400, c.tokenize, c.detokenize)
        prime_pool(c, base + cut_to_tokens(doc.replace("Lanternfish", "Harbour"), 1100, c.tokenize, c.detokenize))
        prompt = base + QUESTION
        got = c.completion(prompt, share=Share(0), id_slot=1, **GEN)
        assert outcomes(c, "swa_window") == 1
        assert got["timings"]["prompt_n"] == len(c.prompt_tokens(prompt))  # computed, nothing taken from the pool
    out = got["shared_prefix"]
    assert (out["status"], out["shared"]) == ("swa_window", 0), out
    assert out["window"] > 400 - GPT_OSS_SHAPE["n_swa"] + 1, out


def test_shared_decode_runs_and_answers_alike(family: str, family_path: Path, logs: Path) -> None:
    n_layer = FAMILIES[family][1]
    off, _ = sharers_at_once(family_path, logs, shared_decode=False, n=N_SHARERS, gen=GEN)
    on, props = sharers_at_once(family_path, logs, shared_decode=True, n=N_SHARERS, gen=GEN)
    stats = props["polykv_shared_decode"]
    # one op per layer and batch of 2-511 rows: at least the sharers' suffix batch and each decode step but the last
    # (whose token is not decoded); on gpt-oss upstream also ends a prompt's batches a few tokens early to checkpoint
    # its sliding-window layers (measured: 11 batches, Qwen3 9)
    assert stats["ops"] % n_layer == 0 and stats["ops"] >= n_layer * GEN["n_predict"], stats
    assert stats["tiles_shared"] > 0, stats
    assert any(not compare(a, b)[0] for a, b in zip(off, on, strict=True))  # the path's rounding reached them
    for a, b in zip(off, on, strict=True):
        assert compare_greedy(a, b, margins=LAYOUT).ok, compare_greedy(a, b, margins=LAYOUT).detail


def test_concurrent_chat_agents_share_the_system_message(family_path: Path, ref: LlamaServer, logs: Path) -> None:
    name = f"{family_path.stem}-any"
    with serve_server(0, agent_slots=AGENTS, ctx=CTX * 2, threads=2, model=family_path, log_dir=logs, name=name) as srv:
        c = srv.client
        system = cut_to_tokens(sample_document(), 600, c.tokenize, c.detokenize)
        convs = [[{"role": "system", "content": system}, {"role": "user", "content": f"Agent {i}: point {i}?"}]
                 for i in range(AGENTS)]  # fmt: skip
        prompts = [c.prompt_tokens(c.apply_template(m)) for m in convs]
        n_sys = min(next(j for j, (x, y) in enumerate(zip(prompts[0], p, strict=False)) if x != y) for p in prompts[1:])
        before = c.metrics()["llamacpp:prompt_tokens_total"]
        ours = ask_all(srv, convs)
        spent = c.metrics()["llamacpp:prompt_tokens_total"] - before
        m = c.metrics()
    assert m["llamacpp:polykv_share_hits_total"] >= AGENTS - 1 and m["llamacpp:polykv_share_promoted_total"] >= 1, m
    hits = sorted(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in ours)
    assert all(h >= n_sys for h in hits[1:]), (hits, n_sys)
    assert spent <= 1.05 * (len(prompts[0]) + sum(len(p) - n_sys for p in prompts[1:])), (spent, n_sys)
    for i, (a, b) in enumerate(zip(ours, ask_all(ref, convs), strict=True)):
        cmp = compare_chat(a["choices"][0], b["choices"][0])
        assert cmp.ok, f"agent {i}: {cmp.detail}"


def ask_all(server: LlamaServer, convs: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
    """The conversations at once, each through the official ``openai`` client."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    greedy: dict[str, Any] = {"temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 5}

    def ask(m: list[dict[str, str]]) -> dict[str, Any]:
        messages: Any = m  # the openai package types each role's message apart
        return client.chat.completions.create(model="m", messages=messages, **greedy).model_dump()

    with ThreadPoolExecutor(len(convs)) as ex:
        return list(ex.map(ask, convs))

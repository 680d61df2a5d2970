"""Configurations where the patched server must refuse to share, reachable with the default model.

Each test starts a real patched server in that configuration, primes the pool slot, sends a
request that sets ``shared_pool_slot``, and checks the refusal (status ``unsupported`` and the
reason string of ``polykv_share_decide()`` in ``native/server/server-polykv.cpp``, patch 0072) and
that the answer is the upstream path's: byte-identical to the same request without the fields,
sent to the same slot after it was emptied (only
:data:`~polykv_py.harness.answers.VOLATILE_FIELDS`, and on the sharer's side
:data:`~polykv_py.harness.answers.SHARE_FIELDS`, removed).

The last test checks the guard that keeps ``n_cache_reuse`` from shifting cells a slot shares. Recurrent and
hybrid memory share under their own rule: test_recurrent.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polykv_py.client import Client, Share
from polykv_py.data import sample_document
from polykv_py.errors import HTTPError
from polykv_py.harness.answers import SHARE_FIELDS, VOLATILE_FIELDS, compare
from polykv_py.harness.compare import LAYOUT, compare_greedy
from polykv_py.harness.texts import cut_to_tokens
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import POOL_SERVER_ARGS, slot_actions_args, slots_args

pytestmark = pytest.mark.integration

GEN: dict[str, Any] = {"n_predict": 8, "temperature": 0, "n_probs": 2, "cache_prompt": True}
QUESTION = "\n\nQuestion: how many docking stations does the bike-share have?\nAnswer:"


def pool_like(binary: Path, model: Path, logs: Path, name: str, extra: list[str]) -> LlamaServer:
    """A pool server's flags (unified KV, idle slots resident, no host cache), 3 slots, plus ``extra``."""
    args = [*POOL_SERVER_ARGS, *slots_args(3, 4096), *slot_actions_args(), *extra]
    return LlamaServer(binary, model, args, log_dir=logs, name=name)


def base_of(c: Client, n_tokens: int = 200) -> str:
    return cut_to_tokens(sample_document(), n_tokens, c.tokenize, c.detokenize)


def refused_like_plain(c: Client, reason: str) -> dict[str, Any]:
    """Prime slot 0, share from it on slot 1: refused with ``reason``; then the same request without the fields."""
    base = base_of(c)
    prompt = base + QUESTION
    p = c.shared_prefix_len(base, prompt)
    n_prompt = len(c.prompt_tokens(prompt))
    c.prime(base, 0)
    got = c.completion(prompt, share=Share(0, p), id_slot=1, **GEN)
    assert got["shared_prefix"] == {
        "pool_slot": 0,
        "requested": p,
        "shared": 0,
        "status": "unsupported",
        "reason": reason,
    }
    assert got["timings"]["prompt_n"] == n_prompt  # the whole prompt computed: nothing taken from the pool
    c.erase_slot(1)
    plain = c.completion(prompt, id_slot=1, **GEN)
    same, diff = compare(got, plain, (*VOLATILE_FIELDS, *SHARE_FIELDS), VOLATILE_FIELDS)
    assert same, diff
    return got


@pytest.fixture(scope="module")
def context_shift(patched_server_bin: Path, model_path: Path, logs: Path) -> Iterator[LlamaServer]:
    with pool_like(patched_server_bin, model_path, logs, "context-shift", ["--context-shift"]) as srv:
        yield srv


def test_context_shift_is_refused(context_shift: LlamaServer) -> None:
    """``--context-shift``: a shift would move shared cells for every sequence that holds them."""
    refused_like_plain(context_shift.client, "context shift enabled")
    assert "cannot share from slot 0: context shift enabled - full reprocess" in context_shift.log_tail(100)


def test_speculative_decoding_is_refused(patched_server_bin: Path, model_path: Path, logs: Path) -> None:
    """Speculative decoding with the model itself as draft (``-md <same gguf> --spec-type draft-simple``).

    At this llama.cpp commit ``-md`` alone loads the draft model but turns nothing on (``--spec-type``
    defaults to ``none``), so the server drops the draft context and a share hits; the type must be named.
    """
    spec = ["-md", str(model_path), "--spec-type", "draft-simple"]
    with pool_like(patched_server_bin, model_path, logs, "speculative", spec) as srv:
        got = refused_like_plain(srv.client, "speculative decoding")
        assert got["timings"]["draft_n"] > 0  # the draft model really drafted
        assert srv.client.slots()[1]["speculative"] is True


def test_infill_is_refused_by_the_server_itself(context_shift: LlamaServer) -> None:
    """``/infill`` takes the pool fields too (docs/shared-prefix.md), but the default model has no FIM tokens:
    the server answers 501 before any task exists, with or without the fields, so the share decision for an
    infill task (which, being a completion-like task, is not refused for its type) is not reachable here."""
    c = context_shift.client
    body: dict[str, Any] = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 4}
    errors = []
    for fields in ({}, Share(0, 4).fields()):
        with pytest.raises(HTTPError) as err:
            c.post_json("/infill", {**body, **fields, "id_slot": 1})
        errors.append((err.value.status, err.value.server_message))
    assert errors[0] == errors[1]
    assert errors[0][0] == 501 and "Infill is not supported by this model" in errors[0][1], errors[0]
    assert context_shift.is_alive()


def test_cache_reuse_skips_shifting_shared_cells(patched_server_bin: Path, model_path: Path, logs: Path) -> None:
    """``--cache-reuse 64``: a slot whose first P cells are shared never chunk-shifts them.

    A sharer on slot 1 holds the pool's cells ``[0, P)``. The next request on slot 1 drops tokens
    ``[k, k + 20)`` of the base (k < P) and keeps the rest: upstream finds the cached chunk from k + 20 on and
    shifts it back by 20 positions (``seq_add``: the reference server with these flags computed 1 of the
    298 prompt tokens here), which with unified KV would move those cells for the pool and every other sharer
    too (the pool would then hold positions ``[k, k + 20)`` twice and end 20 short). The patched server skips
    the reuse (logged) and computes the prompt from k on; the pool then still gives a new sharer the answer
    it gave before.
    """
    with pool_like(patched_server_bin, model_path, logs, "cache-reuse", ["--cache-reuse", "64"]) as srv:
        c = srv.client
        base = base_of(c, 300)
        p = c.shared_prefix_len(base, base + QUESTION)
        c.prime(base, 0)
        other = "\n\nQuestion: what are the four parts of Lanternfish?\nAnswer:"
        before = c.completion(base + other, share=Share(0, p), id_slot=2, **GEN)
        assert before["shared_prefix"]["status"] == "hit"
        c.erase_slot(2)

        first = c.completion(base + QUESTION, share=Share(0, p), id_slot=1, **GEN)
        assert first["shared_prefix"] == {"pool_slot": 0, "requested": p, "shared": p, "status": "hit"}
        k, cut = 100, 20
        base_tokens = c.prompt_tokens(base)
        shifted = [*base_tokens[:k], *base_tokens[k + cut :], *c.tokenize(QUESTION)]
        assert base_tokens[k + cut] != base_tokens[k] and len(base_tokens) - k - cut >= 64
        out = c.completion(shifted, id_slot=1, **GEN)
        log = srv.log_tail(200)
        assert f"polykv: cached cells below {p} may be shared - ignoring n_cache_reuse = 64" in log
        assert out["timings"]["prompt_n"] == len(shifted) - k, out["timings"]  # no chunk reused after k

        after = c.completion(base + other, share=Share(0, p), id_slot=2, **GEN)
        assert after["shared_prefix"]["status"] == "hit"
        cmp = compare_greedy(before, after, margins=LAYOUT)  # other cells in use now: LAYOUT margins
        assert cmp.ok, cmp.detail

"""Sharing on a sliding-window model (Gemma 3 270M: 15 of its 18 layers attend to the last 512 positions).

The KV cache of the sliding-window (SWA) layers holds about 512 cells per slot and reuses a cell once it has
left its sequence's window, so a pool keeps, in those layers, only the window of its own next position. A
share is exact when the pool still holds the window of the sharer's first own token (position P - 511 to
P - 1): always at the pool's full length, for a shorter prefix only while those cells have not been reused.
Otherwise the share is refused with status ``swa_window`` and the prompt computed (``native/server/
server-polykv.cpp``, ``polykv_window_start``). The servers here have 3 slots, so their SWA cache has 2,048
cells (512 x 3 + one batch) and a pool primed with 2,300 tokens has reused the cells of its first ones.

Answers are compared with the pristine reference server's, computed without any sharing (layout margins,
:data:`polykv_py.harness.compare.LAYOUT`). ``tests/integration/test_share_any.py`` runs its zero-config
checks (coalesced agents, promotion, salts, a cancelled leader) on this model too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pool_checks import assert_like_reference, outcomes, prime_pool

from polykv_py.client import Client, Share
from polykv_py.data import sample_document
from polykv_py.harness.texts import cut_to_tokens
from polykv_py.llama_server import LlamaServer
from polykv_py.native import ServerKind
from polykv_py.presets import (
    POOL_SERVER_ARGS,
    custom_server,
    pool_slot_args,
    reference_server,
    slot_actions_args,
    slots_args,
)
from polykv_py.tokens import common_prefix_len

pytestmark = pytest.mark.integration

N_SWA = 512  # gemma3.attention.sliding_window
SLOTS = 3
CTX = 8192
GEN: dict[str, Any] = {"n_predict": 8, "temperature": 0, "n_probs": 2, "cache_prompt": True}
QUESTION = "\n\nQuestion: how many docking stations does the bike-share have?\nAnswer:"


def swa_server(model: Path, logs: Path, name: str, extra: tuple[str, ...] = ()) -> LlamaServer:
    """The patched server with reserved pool 0, 3 slots and unified KV (so a share adds a sequence id to cells)."""
    args = [*POOL_SERVER_ARGS, *slots_args(SLOTS, CTX), *slot_actions_args(), *pool_slot_args([0]), "--metrics", *extra]
    return custom_server(ServerKind.PATCHED, args, model=model, threads=2, log_dir=logs, name=name)


@pytest.fixture(scope="module")
def srv(gemma_path: Path, logs: Path) -> Iterator[LlamaServer]:
    with swa_server(gemma_path, logs, "swa").start() as s:
        yield s


@pytest.fixture(scope="module")
def ref(gemma_path: Path, logs: Path) -> Iterator[LlamaServer]:
    with reference_server(
        model=gemma_path, n_slots=SLOTS, ctx=CTX, threads=2, log_dir=logs, name="swa-reference"
    ).start() as s:
        yield s


@pytest.fixture(scope="module")
def texts(srv: LlamaServer) -> tuple[str, str]:
    """A base of 700 tokens, and the pool's prompt: that base and 1,600 more tokens."""
    with Client(srv.url) as c:
        doc = sample_document()
        base = cut_to_tokens(doc, 700, c.tokenize, c.detokenize)
        extra = cut_to_tokens(doc.replace("Lanternfish", "Harbour"), 1600, c.tokenize, c.detokenize)
    return base, base + "\n\n" + extra


def test_a_pool_shares_at_its_full_length(srv: LlamaServer, ref: LlamaServer, texts: tuple[str, str]) -> None:
    _, pool_prompt = texts
    with Client(srv.url) as c:
        n_pool = prime_pool(c, pool_prompt)
        prompt = pool_prompt + QUESTION
        n_prompt = len(c.prompt_tokens(prompt))
        p = common_prefix_len(c.prompt_tokens(pool_prompt), c.prompt_tokens(prompt))
        assert p > 4 * N_SWA
        c.erase_slot(1)
        got = c.completion(prompt, share=Share(0), id_slot=1, **GEN)
    assert got["shared_prefix"] == {"pool_slot": 0, "requested": None, "shared": p, "status": "hit", "auto": "prefix"}
    assert p >= n_pool - 1  # the pool's whole prompt (its last token may merge with the question's first)
    assert got["timings"]["prompt_n"] == n_prompt - p
    assert_like_reference(ref, prompt, got, GEN)


def test_a_pool_that_reused_the_window_refuses_a_shorter_share(
    srv: LlamaServer, ref: LlamaServer, texts: tuple[str, str]
) -> None:
    """The pool's SWA cells of the base's last 511 positions were reused by its own later tokens: refused."""
    base, pool_prompt = texts
    with Client(srv.url) as c:
        prime_pool(c, pool_prompt)
        prompt = base + QUESTION
        n_prompt = len(c.prompt_tokens(prompt))
        p = common_prefix_len(c.prompt_tokens(pool_prompt), c.prompt_tokens(prompt))
        assert 600 < p < n_prompt
        before = outcomes(c, "swa_window")
        c.erase_slot(1)
        got = c.completion(prompt, share=Share(0), id_slot=1, **GEN)
        assert outcomes(c, "swa_window") == before + 1
    out = got["shared_prefix"]
    assert (out["status"], out["shared"]) == ("swa_window", 0), out
    assert out["window"] > p - N_SWA + 1, out  # the first position the pool's SWA layers hold
    assert got["timings"]["prompt_n"] == n_prompt  # computed, nothing taken from the pool
    assert "sliding-window layers start at position" in srv.log_tail(200)
    assert_like_reference(ref, prompt, got, GEN)


def test_swa_full_keeps_every_cell_and_shares_a_shorter_prefix(
    gemma_path: Path, ref: LlamaServer, logs: Path, texts: tuple[str, str]
) -> None:
    """``--swa-full`` sizes the SWA cache like the full one: the pool's cells are not reused and the base shares."""
    base, pool_prompt = texts
    with swa_server(gemma_path, logs, "swa-full", ("--swa-full",)).start() as s, Client(s.url) as c:
        prime_pool(c, pool_prompt)
        prompt = base + QUESTION
        n_prompt = len(c.prompt_tokens(prompt))
        p = common_prefix_len(c.prompt_tokens(pool_prompt), c.prompt_tokens(prompt))
        got = c.completion(prompt, share=Share(0), id_slot=1, **GEN)
    assert got["shared_prefix"] == {"pool_slot": 0, "requested": None, "shared": p, "status": "hit", "auto": "prefix"}
    assert got["timings"]["prompt_n"] == n_prompt - p
    assert_like_reference(ref, prompt, got, GEN)


def test_a_pool_file_holds_the_window(srv: LlamaServer, ref: LlamaServer, texts: tuple[str, str]) -> None:
    """A saved pool keeps its SWA layers' window (llama's sequence state skips cells outside it): restored, it
    shares at its full length and refuses a shorter prefix, whose window the file never held."""
    base, pool_prompt = texts
    with Client(srv.url) as c:
        n_pool = prime_pool(c, pool_prompt)
        saved = c.save_pool(0, "swa.pkvpool")
        assert saved["n_saved"] == n_pool
        c.erase_slot(0)
        assert not c.pools()[0].resident
        c.restore_pool(0, "swa.pkvpool")
        (pool,) = c.pools()
        assert pool.resident and pool.n_tokens == n_pool and pool.restored_from == "swa.pkvpool", pool

        prompt = pool_prompt + QUESTION
        c.erase_slot(1)
        full = c.completion(prompt, share=Share(0), id_slot=1, **GEN)
        assert full["shared_prefix"]["status"] == "hit" and full["shared_prefix"]["shared"] >= n_pool - 1
        assert_like_reference(ref, prompt, full, GEN)

        c.erase_slot(1)
        short = c.completion(base + QUESTION, share=Share(0), id_slot=1, **GEN)
    assert short["shared_prefix"]["status"] == "swa_window", short["shared_prefix"]
    assert short["shared_prefix"]["window"] >= n_pool - N_SWA

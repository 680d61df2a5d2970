"""Recurrent and hybrid memory: a pool's state is shared at exactly its own position, and nowhere else.

A recurrent layer (Mamba; LFM2's short convolutions) keeps one state per sequence, the state after its last token,
so a pool's cells are exact for one continuation only: at the pool's full length P (docs/models.md). Each test runs
on two random-weight models written by :mod:`tiny_models`: a 2-layer Mamba (recurrent memory only) and a 4-layer
LFM2 (hybrid: 2 short-convolution layers, 2 attention layers, one KV cache and one recurrent state per sequence).

- a share of the pool's P tokens is a ``hit``: the task computes only its suffix, and answers as the pristine
  reference server does computing the whole prompt;
- sharers in turn take a copy of the state (``llama_memory_recurrent::find_slot`` copies a state two sequences
  hold before one goes on): the pool's state is unchanged, the first sharer's answer comes back byte for byte;
- a shorter prefix, or the whole prompt (which would re-evaluate the pool's last token), is refused
  ``recurrent_state`` with the one length the state serves, counted in ``/metrics``, nothing shared;
- a pool file carries the state: restored, the pool shares at P again;
- ``--shared-decode`` runs on LFM2's attention layers (answers within layout margins of the server without it);
  Mamba has no attention for it: it never runs, and the answers are byte-identical;
- ``--share-any`` (whose sources are slots past the prefix) turns itself off at start.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pool_checks import assert_like_reference, outcomes, prime_pool, sharers_at_once
from tiny_models import LFM2_SHAPE, write_lfm2, write_mamba

from polykv_py.client import Share
from polykv_py.data import sample_document
from polykv_py.harness.answers import SHARE_FIELDS, VOLATILE_FIELDS, compare
from polykv_py.harness.compare import LAYOUT, compare_greedy
from polykv_py.harness.texts import cut_to_tokens
from polykv_py.llama_server import LlamaServer
from polykv_py.native import ServerKind
from polykv_py.presets import (
    POOL_SERVER_ARGS,
    custom_server,
    pool_slot_args,
    reference_server,
    serve_server,
    slot_actions_args,
    slots_args,
)

pytestmark = pytest.mark.integration

SLOTS = 3
CTX = 4096
GEN: dict[str, Any] = {"n_predict": 8, "temperature": 0, "n_probs": 2, "cache_prompt": True}
QUESTIONS = (
    "\n\nQuestion: how many docking stations does the bike-share have?\nAnswer:",
    "\n\nQuestion: who maintains the bicycles?\nAnswer:",
)
WRITERS = {"mamba": write_mamba, "lfm2": write_lfm2}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def recurrent_model(request: pytest.FixtureRequest, model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each tiny recurrent model in turn: Mamba (recurrent only), LFM2 (hybrid)."""
    return WRITERS[request.param](tmp_path_factory.mktemp("models") / f"tiny-{request.param}.gguf", model_path)


@pytest.fixture(scope="module")
def srv(recurrent_model: Path, logs: Path) -> Iterator[LlamaServer]:
    """The patched server: reserved pool 0, 3 slots, unified KV, pool files."""
    args = [*POOL_SERVER_ARGS, *slots_args(SLOTS, CTX), *slot_actions_args(), *pool_slot_args([0]), "--metrics"]
    name = f"recurrent-{recurrent_model.stem}"
    with custom_server(ServerKind.PATCHED, args, model=recurrent_model, threads=2, log_dir=logs, name=name) as s:
        yield s


@pytest.fixture(scope="module")
def ref(recurrent_model: Path, logs: Path) -> Iterator[LlamaServer]:
    name = f"recurrent-{recurrent_model.stem}-reference"
    with reference_server(model=recurrent_model, n_slots=SLOTS, ctx=CTX, threads=2, log_dir=logs, name=name) as s:
        yield s


@pytest.fixture(scope="module")
def base(srv: LlamaServer) -> str:
    """The pool's prompt: 300 tokens of the sample document."""
    return cut_to_tokens(sample_document(), 300, srv.client.tokenize, srv.client.detokenize)


def test_a_pool_shares_its_state_at_its_full_length(srv: LlamaServer, ref: LlamaServer, base: str) -> None:
    c = srv.client
    n_pool = prime_pool(c, base)
    prompt = base + QUESTIONS[0]
    n_prompt = len(c.prompt_tokens(prompt))
    assert c.shared_prefix_len(base, prompt) == n_pool  # the question starts a new token
    hits = c.metrics()["llamacpp:polykv_share_hits_total"]
    c.erase_slot(1)
    got = c.completion(prompt, share=Share(0), id_slot=1, **GEN)
    hit = {"pool_slot": 0, "requested": None, "shared": n_pool, "status": "hit", "auto": "prefix"}
    assert got["shared_prefix"] == hit
    assert got["timings"]["prompt_n"] == n_prompt - n_pool  # only the question computed
    assert c.metrics()["llamacpp:polykv_share_hits_total"] == hits + 1
    assert_like_reference(ref, prompt, got, GEN)


def test_sharers_copy_the_state_and_leave_the_pool_as_it_was(srv: LlamaServer, base: str) -> None:
    """Two sharers go on from the pool's state on slots 1 and 2; a third share then answers like the first, byte
    for byte: the state the sharers advanced was a copy, not the pool's."""
    c = srv.client
    n_pool = prime_pool(c, base)
    answers = []
    for slot, question in ((1, QUESTIONS[0]), (2, QUESTIONS[1]), (1, QUESTIONS[0])):
        c.erase_slot(slot)
        answers.append(c.completion(base + question, share=Share(0, n_pool), id_slot=slot, **GEN))
    assert [a["shared_prefix"]["status"] for a in answers] == ["hit"] * 3
    (pool,) = c.pools()
    assert pool.resident and pool.n_tokens == n_pool, pool
    same, diff = compare(answers[0], answers[2], VOLATILE_FIELDS)
    assert same, diff


def test_a_shorter_prefix_or_the_whole_prompt_is_refused(srv: LlamaServer, ref: LlamaServer, base: str) -> None:
    """The state follows the pool's last token: no share of fewer tokens, none that would re-evaluate that token."""
    c = srv.client
    n_pool = prime_pool(c, base)
    prompt = base + QUESTIONS[0]
    n_prompt = len(c.prompt_tokens(prompt))
    before = outcomes(c, "recurrent_state")
    c.erase_slot(1)
    short = c.completion(prompt, share=Share(0, n_pool - 5), id_slot=1, **GEN)
    assert short["shared_prefix"] == {
        "pool_slot": 0,
        "requested": n_pool - 5,
        "shared": 0,
        "status": "recurrent_state",
        "state": n_pool,
    }
    assert short["timings"]["prompt_n"] == n_prompt  # computed, nothing taken from the pool
    assert "recurrent state follows position" in srv.log_tail(50)
    assert_like_reference(ref, prompt, short, GEN)

    c.erase_slot(1)
    whole = c.completion(base, share=Share(0, n_pool), id_slot=1, **GEN)
    assert (whole["shared_prefix"]["status"], whole["shared_prefix"]["shared"]) == ("recurrent_state", 0)
    assert whole["timings"]["prompt_n"] == n_pool
    assert outcomes(c, "recurrent_state") == before + 2

    c.erase_slot(1)  # the refusals changed nothing: the plain request answers alike
    plain = c.completion(prompt, id_slot=1, **GEN)
    same, diff = compare(short, plain, (*VOLATILE_FIELDS, *SHARE_FIELDS), VOLATILE_FIELDS)
    assert same, diff


def test_a_pool_file_carries_the_state(srv: LlamaServer, ref: LlamaServer, base: str) -> None:
    c = srv.client
    n_pool = prime_pool(c, base)
    saved = c.save_pool(0, "recurrent.pkvpool")
    assert saved["n_saved"] == n_pool
    c.erase_slot(0)
    assert not c.pools()[0].resident
    c.restore_pool(0, "recurrent.pkvpool")
    (pool,) = c.pools()
    assert pool.resident and pool.n_tokens == n_pool and pool.restored_from == "recurrent.pkvpool", pool

    prompt = base + QUESTIONS[1]
    c.erase_slot(1)
    got = c.completion(prompt, share=Share(0), id_slot=1, **GEN)
    assert (got["shared_prefix"]["status"], got["shared_prefix"]["shared"]) == ("hit", n_pool), got["shared_prefix"]
    assert got["timings"]["prompt_n"] == len(c.prompt_tokens(prompt)) - n_pool
    assert_like_reference(ref, prompt, got, GEN)


def test_shared_decode_takes_the_attention_layers(recurrent_model: Path, logs: Path) -> None:
    n = 4
    off, _ = sharers_at_once(recurrent_model, logs, shared_decode=False, n=n, gen=GEN)
    on, props = sharers_at_once(recurrent_model, logs, shared_decode=True, n=n, gen=GEN)
    stats = props["polykv_shared_decode"]
    if "lfm2" in recurrent_model.stem:
        n_attn = LFM2_SHAPE["n_layer"] // 2  # attention on odd layers
        assert stats["ops"] % n_attn == 0 and stats["ops"] >= n_attn * GEN["n_predict"], stats
        assert stats["tiles_shared"] > 0, stats
        for a, b in zip(off, on, strict=True):
            assert compare_greedy(a, b, margins=LAYOUT).ok, compare_greedy(a, b, margins=LAYOUT).detail
    else:  # Mamba: no attention node
        assert stats["ops"] == 0, stats
        for i, (a, b) in enumerate(zip(off, on, strict=True)):
            same, diff = compare(a, b)
            assert same, f"sharer {i}: {diff}"


def test_share_any_is_off(recurrent_model: Path, logs: Path) -> None:
    """``polykv serve``'s server starts with ``--share-any`` off (a warning), and shares nothing."""
    name = f"{recurrent_model.stem}-any"
    with serve_server(0, agent_slots=2, ctx=CTX, threads=2, model=recurrent_model, log_dir=logs, name=name) as srv:
        c = srv.client
        assert "--share-any: no prefix can be shared here (memory without partial sequence removal" in srv.log_tail(200)
        base = cut_to_tokens(sample_document(), 200, c.tokenize, c.detokenize)
        answers = [c.completion(base + q, **GEN) for q in QUESTIONS]
        assert all("shared_prefix" not in a for a in answers), [a.get("shared_prefix") for a in answers]
        assert c.metrics().get("llamacpp:polykv_share_any_total", 0.0) == 0.0

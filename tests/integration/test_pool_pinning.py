"""``--pool-slots`` (patch 0073): a reserved pool survives upstream's default flags.

The servers here deliberately differ from :func:`polykv_py.presets.pool_server` (upstream's idle-slot
caching stays on), so their flags are spelled out, from the presets' constants.

Each scenario runs twice, with and without the reservation, on the same flags: the
unreserved run shows what upstream does to an idle pool slot (the control), the
reserved run shows the pool staying resident and the share hitting.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from polykv_py.client import COMPLETION, Client, Share, aggregate
from polykv_py.data import sample_document
from polykv_py.errors import ServerError
from polykv_py.harness.compare import LAYOUT, compare_greedy
from polykv_py.harness.texts import cut_to_tokens
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import NO_HOST_CACHE, UNIFIED_KV, pool_slot_args, slots_args

pytestmark = pytest.mark.integration

GREEDY: dict[str, Any] = {"temperature": 0, "cache_prompt": True}


def text_of(c: Client, n_tokens: int, seed: int) -> str:
    """A prompt of exactly ``n_tokens`` tokens (numbered facts, cut at a token boundary)."""
    lines = [f"Record {seed}-{i}: the archive lists item {i * 7 + seed} under shelf {i % 13}." for i in range(n_tokens)]
    out = cut_to_tokens("\n".join(lines), n_tokens, c.tokenize, c.detokenize)
    assert len(c.tokenize(out)) == n_tokens, "prompt does not round-trip at this cut"
    return out


def pool_tokens(c: Client, slot: int = 0) -> int:
    return int(next(s for s in c.slots() if s["id"] == slot).get("n_prompt_tokens", 0))


def share(c: Client, base: str, question: str, **params: Any) -> dict[str, Any]:
    """A sharer of the pool in slot 0 asking ``question`` after ``base``, with an explicit P (the common prefix of
    the tokenized prompts, so a pool holding another text is a ``mismatch``, not an automatic ``no_prefix``)."""
    prompt = base + question
    p = c.shared_prefix_len(base, prompt)
    return c.completion(prompt, share=Share(0, p), **{"n_predict": 4, **GREEDY, **params})


def start(bin_: Path, model: Path, logs: Path, name: str, args: list[str]) -> LlamaServer:
    return LlamaServer(bin_, model, args, log_dir=logs, name=name).start()


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    return tmp_path


# ----------------------------------------------------------------- idle-slot caching
@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "control"])
def test_pool_survives_idle_slot_caching(
    reserved: bool, patched_server_bin: Path, model_path: Path, logs: Path
) -> None:
    """Upstream's defaults (host cache on, idle slots saved and cleared): only a reserved pool stays."""
    args = [UNIFIED_KV, *slots_args(3, 4096), "--slots", *pool_slot_args([0] if reserved else [])]
    with start(patched_server_bin, model_path, logs, "idle-cache", args) as srv:
        c = srv.client
        base = text_of(c, 300, 1)
        c.prime(base, 0, n_predict=1)
        # any other task launching triggers [TAG_IDLE_SLOT_CLEAR] for every idle slot
        c.completion("Unrelated: name a color.", n_predict=2, **GREEDY)
        out = share(c, base, "\nQuestion: which shelf holds item 8? Answer:")
        status = out["shared_prefix"]["status"]
        if reserved:
            assert status == "hit", out["shared_prefix"]
            assert out["shared_prefix"]["shared"] == out["shared_prefix"]["requested"] >= 299
            assert pool_tokens(c) >= 300
            assert next(s for s in c.slots() if s["id"] == 0).get("polykv_pool") is True
        else:
            # the pool was saved to the host cache and cleared; the sharer may restore it from RAM as a
            # private copy (own_cache) instead of sharing
            assert status in ("not_resident", "own_cache"), out["shared_prefix"]
            assert pool_tokens(c) == 0


# ----------------------------------------------------------------- purge for room
@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "control"])
def test_pool_not_purged_when_kv_runs_out(
    reserved: bool, patched_server_bin: Path, model_path: Path, logs: Path
) -> None:
    """Unified KV full: upstream purges idle slots in id order (the pool first); a reserved pool is skipped."""
    args = [UNIFIED_KV, *slots_args(3, 1024), "-b", "256", "-ub", "256", *NO_HOST_CACHE, "--slots"]
    args += pool_slot_args([0] if reserved else [])
    with start(patched_server_bin, model_path, logs, "purge", args) as srv:
        c = srv.client
        base = text_of(c, 400, 2)
        c.prime(base, 0, n_predict=1)
        c.completion(text_of(c, 380, 3), id_slot=1, n_predict=1, **GREEDY)  # idle afterwards, ~381 cells
        # 400 + 381 cells in use: a 360-token prompt does not fit without purging an idle slot
        out = c.completion(text_of(c, 360, 4), id_slot=2, n_predict=1, **GREEDY)
        assert out["tokens_evaluated"] == 360
        assert "purging slot" in srv.log_tail(400)
        if reserved:
            assert "purging slot 1" in srv.log_tail(400) and "purging slot 0" not in srv.log_tail(400)
            assert pool_tokens(c) >= 400
            assert share(c, base, "\nQ: shelf of item 9?")["shared_prefix"]["status"] == "hit"
        else:
            assert "purging slot 0" in srv.log_tail(400)
            assert share(c, base, "\nQ: shelf of item 9?")["shared_prefix"]["status"] == "not_resident"


# ----------------------------------------------------------------- scheduling
def test_unpinned_requests_never_run_on_a_reserved_pool(patched_server_bin: Path, model_path: Path, logs: Path) -> None:
    """More concurrent unpinned requests than free slots wait for a free slot; none lands on the pool."""
    args = [UNIFIED_KV, *slots_args(3, 4096), *NO_HOST_CACHE, "--slots", *pool_slot_args([0])]
    with start(patched_server_bin, model_path, logs, "sched", args) as srv:
        c = srv.client
        base = text_of(c, 200, 5)
        c.prime(base, 0, n_predict=1)

        async def burst() -> list[dict[str, Any]]:
            async with srv.async_client() as ac:
                return list(
                    await asyncio.gather(
                        *[ac.completion(f"Task {i}: count to {i + 3}.", n_predict=6, **GREEDY) for i in range(6)]
                    )
                )

        outs = asyncio.run(burst())
        assert sorted({o["id_slot"] for o in outs}) == [1, 2]
        assert pool_tokens(c) >= 200
        out = share(c, base, "\nQ: which shelf holds item 5?")
        assert out["shared_prefix"]["status"] == "hit"
        assert out["id_slot"] != 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0,x", "'x' is not a slot id"),
        ("0,0", "listed twice"),
        ("3", "slot 3 does not exist"),
        ("0,1,2", "all 3 slots are reserved"),
    ],
)
def test_bad_pool_slots_stop_the_server_with_a_reason(
    value: str, message: str, patched_server_bin: Path, model_path: Path, logs: Path
) -> None:
    srv = LlamaServer(
        patched_server_bin,
        model_path,
        [*slots_args(3, 1024), "--pool-slots", value],
        log_dir=logs,
        name="bad-pool",
        start_timeout=60,
    )
    with pytest.raises(ServerError) as err:
        srv.start()
    assert message in str(err.value)
    assert srv.returncode not in (None, 0)


def test_reference_server_refuses_pool_slots(model_path: Path, logs: Path) -> None:
    """The reference binary parses the flag (shared libllama-common) but ignores it: the launcher refuses."""
    with pytest.raises(ServerError, match="--pool-slots"):
        LlamaServer(kind="upstream", model=model_path, args=["--pool-slots", "0"], log_dir=logs)


# ----------------------------------------------------------------- re-priming under sharers
@pytest.fixture(scope="module")
def pool_server(
    patched_server_bin: Path, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    slots = [*slots_args(4, 4096), *pool_slot_args([0]), "--slot-save-path", str(tmp_path_factory.mktemp("slots"))]
    args = [UNIFIED_KV, *NO_HOST_CACHE, "--slots", *slots]
    with LlamaServer(
        patched_server_bin, model_path, args, log_dir=tmp_path_factory.mktemp("reprime"), name="reprime"
    ) as srv:
        yield srv


QUESTIONS = ["\nQuestion: which shelf holds item 15? Answer:", "\nQuestion: list three items. Answer:"]
N_SHARER_TOKENS = 40


@dataclass
class Run:
    """Two concurrent sharers' answers, and when each one's stream chunks arrived (monotonic seconds)."""

    answers: list[dict[str, Any]]
    chunk_times: list[list[float]]


def _sharers(srv: LlamaServer, base: str, on_first_token: threading.Event | None) -> Run:
    """Two sharers generating 40 tokens each, concurrently; sets ``on_first_token`` once both stream."""
    c = srv.client
    p = c.shared_prefix_len(base, base + QUESTIONS[0])
    run = Run([{}, {}], [[], []])
    started = [threading.Event(), threading.Event()]

    def one(i: int) -> None:
        with Client(srv.url, server=srv) as own:
            chunks = []
            body = {
                "prompt": base + QUESTIONS[i],
                "id_slot": i + 1,
                **Share(0, p).fields(),
                "n_predict": N_SHARER_TOKENS,
                "ignore_eos": True,  # all 40 tokens: the sharers must still be generating when the re-prime ends
                "n_probs": 2,
                **GREEDY,
            }
            for ev in own.stream_events(COMPLETION, body):
                chunks.append(ev)
                run.chunk_times[i].append(time.monotonic())
                started[i].set()
            run.answers[i] = aggregate(COMPLETION, chunks)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    if on_first_token is not None:
        for ev in started:
            ev.wait(120)
        on_first_token.set()
    for t in threads:
        t.join(300)
    return run


def test_repriming_the_pool_does_not_disturb_running_sharers(pool_server: LlamaServer) -> None:
    """Re-prime the pool with another text while two sharers generate over its old cells: their answers stay.

    The two bases have nothing in common (numbered shelf records versus the sample design document), so
    a sharer whose cells were overwritten by the new base would answer about another text. The timestamps
    prove the overlap: the re-prime was sent after both sharers had streamed their first token and was
    answered while both were still streaming.
    """
    c = pool_server.client
    base_a = text_of(c, 500, 6)
    base_b = cut_to_tokens(sample_document(), 500, c.tokenize, c.detokenize)
    assert len(c.tokenize(base_b)) == 500
    assert c.shared_prefix_len(base_a, base_b) < 5, "the two bases must differ from their first tokens"

    # reference: the two sharers alone over pool A
    for s in range(4):
        c.erase_slot(s)
    c.prime(base_a, 0, n_predict=1)
    calm = _sharers(pool_server, base_a, None)
    assert [r["shared_prefix"]["status"] for r in calm.answers] == ["hit", "hit"]

    # again, and re-prime the pool with B while both are generating
    for s in (1, 2):
        c.erase_slot(s)
    go = threading.Event()
    reprimed: dict[str, Any] = {}
    window: list[float] = []

    def reprime() -> None:
        go.wait(120)
        window.append(time.monotonic())
        reprimed.update(c.prime(base_b, 0, n_predict=1))
        window.append(time.monotonic())

    t = threading.Thread(target=reprime)
    t.start()
    stormy = _sharers(pool_server, base_a, go)
    t.join(300)

    assert reprimed["tokens_evaluated"] == 500 and reprimed["id_slot"] == 0
    assert reprimed["timings"]["prompt_n"] == 500, "the pool must have computed B itself"
    sent, answered = window
    for i, times in enumerate(stormy.chunk_times):
        assert len(stormy.answers[i]["tokens"]) == N_SHARER_TOKENS
        before = sum(x < sent for x in times)
        after = sum(x > answered for x in times)
        # the re-prime ran while this sharer was generating: tokens came before it was sent and after it returned
        # (measured here: 1-2 chunks before, 1 during, 38-39 after)
        assert before >= 1 and after >= 1, (i, before, after, len(times))
    assert [r["shared_prefix"]["status"] for r in stormy.answers] == ["hit", "hit"]
    for before_, during in zip(calm.answers, stormy.answers, strict=True):
        cmp = compare_greedy(before_, during, margins=LAYOUT)  # measured here: identical, max drift 0.16
        assert cmp.ok, cmp.detail  # the shared cells still held A's KV while B was written
    # the pool now serves B, and refuses A's prompts as a mismatch
    assert share(c, base_b, QUESTIONS[0])["shared_prefix"]["status"] == "hit"
    c.erase_slot(3)  # a slot without A cached (else: own_cache)
    refused = share(c, base_a, QUESTIONS[0], id_slot=3)["shared_prefix"]
    assert refused["status"] == "mismatch" and refused["common"] < 5, refused

"""The patched llama-server's shared KV prefix (patches 0071/0072) against the real model.

Every share must be exact or refused:
- a hit is byte-identical (text and log-probabilities) to the reference server answering the
  same request from its own cache after the same priming request (docs/design-notes.md, trap 2), and
  the KV cell layout is the same in both (P equals the pool's token count, see
  docs/shared-prefix.md "Exactness");
- every refusal leaves the request on the upstream path, so it answers like the reference;
- a request without the new fields is answered byte-identically and gets no new field.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polykv_py.client import Client, Share
from polykv_py.errors import HTTPError
from polykv_py.harness.answers import compare
from polykv_py.harness.compare import LAYOUT, compare_greedy
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import NO_CACHE_IDLE, NO_CLEAR_IDLE, UNIFIED_KV, pool_server, reference_server, slots_args

pytestmark = pytest.mark.integration

N_SLOTS = 4
CTX = 8192
GEN: dict[str, Any] = {"n_predict": 12, "temperature": 0, "cache_prompt": True, "n_probs": 3}


def make_base(n: int = 12) -> str:
    words = [
        "river",
        "mountain",
        "engine",
        "library",
        "garden",
        "signal",
        "harbor",
        "crystal",
        "forest",
        "market",
        "lantern",
        "bridge",
        "orchard",
        "compass",
        "violin",
        "meadow",
        "canyon",
        "archive",
        "beacon",
        "glacier",
    ]
    lines = []
    for i in range(n):
        w = [words[(i * 7 + k * 3) % len(words)] for k in range(6)]
        lines.append(
            f"Fact {i}: The {w[0]} near the {w[1]} keeps a record of the {w[2]}, while the {w[3]} "
            f"explains why the {w[4]} and the {w[5]} were built in year {1700 + i * 3}."
        )
    return "Knowledge base.\n\n" + "\n".join(lines)


#: base whose tokens are a prefix of base + "\n" + question (P == the pool's token count)
BASE = make_base()
#: the same base ending in "\n\n": alone it ends in one "\n\n" token, followed by text in "\n", "\n"
BASE_NN = BASE + "\n\n"
QUESTIONS = [
    "\nQuestion: what does the engine near the library keep? Answer:",
    "\nQuestion: in which year was fact 7 recorded? Answer:",
    "\nQuestion: name two things from fact 3. Answer:",
]


def erase_all(c: Client) -> None:
    for s in range(N_SLOTS):
        c.erase_slot(s)


def erase_all_but_pool(c: Client) -> None:
    for s in range(1, N_SLOTS):
        c.erase_slot(s)


def share(c: Client, prompt: str, p: int, slot: int | None = 1, pool: int = 0, **params: Any) -> dict[str, Any]:
    """A sharer asking for P = ``p`` (right or wrong: the server must check it)."""
    if slot is not None:
        params["id_slot"] = slot
    return c.completion(prompt, share=Share(pool, p), **{**GEN, **params})


def same_answer(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["content"] == b["content"]
    assert a["completion_probabilities"] == b["completion_probabilities"]


def start(binary: Path, model: Path, args: list[str], logs: Path, name: str) -> LlamaServer:
    """A server with other flags than a pool server's (each test says why)."""
    slots = [*slots_args(N_SLOTS, CTX), "--slot-save-path", str(logs)]
    return LlamaServer(binary, model, [*slots, *args], log_dir=logs, name=name).start()


@pytest.fixture(scope="module")
def patched(patched_server_bin: Path, model_path: Path, logs: Path) -> Iterator[LlamaServer]:
    # no host prompt cache: both servers must hold exactly the same KV state, and no reserved pool slot:
    # both must schedule an unpinned request alike (see test_without_fields_...)
    srv = pool_server(binary=patched_server_bin, model=model_path, n_agents_parallel=N_SLOTS - 1, ctx=CTX,
                      pool_slot=None, track_kv=False, log_dir=logs, name="patched-kvu").start()  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(upstream_server_bin: Path, model_path: Path, logs: Path) -> Iterator[LlamaServer]:
    srv = reference_server(binary=upstream_server_bin, model=model_path, n_slots=N_SLOTS, ctx=CTX, log_dir=logs,
                           name="upstream-kvu").start()  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def pc(patched: LlamaServer) -> Client:
    erase_all(patched.client)
    return patched.client


@pytest.fixture
def rc(reference: LlamaServer) -> Client:
    erase_all(reference.client)
    return reference.client


# ------------------------------------------------------------------------------ hit


@pytest.mark.parametrize("qi", range(len(QUESTIONS)))
def test_hit_is_byte_identical_to_reference_own_cache(pc: Client, rc: Client, qi: int) -> None:
    prompt = BASE + QUESTIONS[qi]
    p = pc.shared_prefix_len(BASE, prompt)
    n_prompt = len(pc.prompt_tokens(prompt))
    assert p == len(pc.prompt_tokens(BASE))

    pc.prime(BASE, 0)
    got = share(pc, prompt, p)
    assert got["shared_prefix"] == {"pool_slot": 0, "requested": p, "shared": p, "status": "hit"}
    assert got["timings"]["prompt_n"] == n_prompt - p
    assert got["tokens_evaluated"] == n_prompt

    rc.prime(BASE, 0)
    ref = rc.completion(prompt, id_slot=0, **GEN)
    assert ref["timings"]["prompt_n"] == n_prompt - p
    same_answer(got, ref)


def test_whole_prompt_shared_evaluates_one_token(pc: Client) -> None:
    p = len(pc.prompt_tokens(BASE))
    pc.prime(BASE, 0)
    got = share(pc, BASE, p)
    assert got["shared_prefix"] == {"pool_slot": 0, "requested": p, "shared": p - 1, "status": "hit"}
    assert got["timings"]["prompt_n"] == 1


def test_pool_longer_than_p_and_fan_out(pc: Client) -> None:
    """Concurrent unpinned sharers of a pool that holds more than P: each hits (or reuses its slot's copy) and
    answers like it does alone (compare_greedy with LAYOUT margins: concurrent cells sit elsewhere)."""
    pc.completion(BASE, id_slot=0, n_predict=4, temperature=0)  # the pool holds BASE + 4 generated tokens
    p = pc.shared_prefix_len(BASE, BASE + QUESTIONS[0])
    results: list[dict[str, Any]] = [{} for _ in QUESTIONS]

    def run(i: int) -> None:  # unpinned: must not land on the pool slot
        results[i] = share(pc, BASE + QUESTIONS[i], p, slot=None, ignore_eos=True)  # 12 tokens to compare

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert r["id_slot"] != 0
        # a sharer launched after another one finished may find the prefix in that slot's own cache
        assert r["shared_prefix"]["status"] in ("hit", "own_cache")
        assert r["shared_prefix"]["shared"] == (p if r["shared_prefix"]["status"] == "hit" else 0)
    assert sum(r["shared_prefix"]["status"] == "hit" for r in results) >= 1
    for i, together in enumerate(results):
        erase_all_but_pool(pc)
        alone = share(pc, BASE + QUESTIONS[i], p, ignore_eos=True)
        assert alone["shared_prefix"]["status"] == "hit"
        cmp = compare_greedy(alone, together, margins=LAYOUT)
        assert cmp.ok, f"question {i}: {cmp.detail}"


# ------------------------------------------------------------------------------ refusals


def test_p_from_tokenized_base_alone_is_refused(pc: Client, rc: Client) -> None:
    """docs/design-notes.md, trap 1: len(tokenize(base)) is one token too many at a "\\n\\n" boundary."""
    prompt = BASE_NN + QUESTIONS[0].lstrip("\n")
    wrong_p = len(pc.prompt_tokens(BASE_NN))
    right_p = pc.shared_prefix_len(BASE_NN, prompt)
    assert right_p == wrong_p - 1

    pc.prime(BASE_NN, 0)
    got = share(pc, prompt, wrong_p)
    assert got["shared_prefix"] == {
        "pool_slot": 0,
        "requested": wrong_p,
        "shared": 0,
        "status": "mismatch",
        "common": right_p,
    }
    assert got["timings"]["prompt_n"] == len(pc.prompt_tokens(prompt))

    rc.prime(BASE_NN, 0)
    ref = rc.completion(prompt, id_slot=1, **GEN)  # same: an empty slot, whole prompt processed
    same_answer(got, ref)


def test_other_text_is_refused(pc: Client) -> None:
    pc.prime(BASE, 0)
    other = "Completely different text about cooking pasta. " * 20 + QUESTIONS[0]
    got = share(pc, other, 100)
    assert got["shared_prefix"]["status"] == "mismatch"
    assert got["shared_prefix"]["shared"] == 0 and got["shared_prefix"]["common"] < 100
    assert got["timings"]["prompt_n"] == len(pc.prompt_tokens(other))


def test_not_resident_when_pool_shorter(pc: Client) -> None:
    pc.prime(BASE, 0)
    got = share(pc, BASE + QUESTIONS[0], 10**6)  # clamped to the prompt, longer than the pool
    assert got["shared_prefix"]["status"] == "not_resident"
    assert got["shared_prefix"]["requested"] == 10**6 and got["shared_prefix"]["shared"] == 0


def test_own_cache_self_and_no_prefix(pc: Client) -> None:
    prompt = BASE + QUESTIONS[0]
    p = pc.shared_prefix_len(BASE, prompt)
    pc.prime(BASE, 0)
    assert share(pc, prompt, p)["shared_prefix"]["status"] == "hit"
    again = share(pc, prompt, p)
    assert again["shared_prefix"] == {"pool_slot": 0, "requested": p, "shared": 0, "status": "own_cache"}
    assert share(pc, prompt, p, slot=0)["shared_prefix"]["status"] == "self"
    assert share(pc, prompt, 0, slot=2)["shared_prefix"]["status"] == "no_prefix"
    empty = pc.completion("", share=Share(0, 5), n_predict=1)
    assert empty["shared_prefix"]["status"] == "skipped"


def test_pool_busy(pc: Client) -> None:
    prompt = BASE + QUESTIONS[0]
    p = pc.shared_prefix_len(BASE, prompt)
    pc.prime(BASE, 0)
    busy = threading.Thread(
        target=pc.completion,
        args=(BASE + "\nWrite a long story:",),
        kwargs={"id_slot": 0, "n_predict": 96, "temperature": 0, "ignore_eos": True},
    )
    busy.start()
    try:
        deadline = time.monotonic() + 60
        while not any(s["id"] == 0 and s["is_processing"] for s in pc.slots()):
            assert time.monotonic() < deadline, "pool slot never became busy"
            time.sleep(0.05)
        got = share(pc, prompt, p)
    finally:
        busy.join()
    assert got["shared_prefix"]["status"] == "pool_busy"
    assert got["timings"]["prompt_n"] == len(pc.prompt_tokens(prompt))
    # refused: the upstream path, so the same request without the fields, alone on an empty slot, answers alike
    # (LAYOUT margins: the busy pool's story was computed in the same batches)
    pc.erase_slot(1)
    alone = pc.completion(prompt, id_slot=1, **GEN)
    cmp = compare_greedy(alone, got, margins=LAYOUT)
    assert cmp.ok, cmp.detail


# ------------------------------------------------------------------------------ invalid input

BAD = [
    ("shared_pool_slot", "0"),
    ("shared_pool_slot", 1.5),
    ("shared_pool_slot", -2),
    ("shared_pool_slot", N_SLOTS),
    ("shared_pool_slot", True),
    ("shared_pool_slot", 2**64 - 1),
    ("shared_prefix_n_tokens", -1),
    ("shared_prefix_n_tokens", 2**31),
    ("shared_prefix_n_tokens", 1e3),
    ("shared_prefix_n_tokens", [1]),
]


@pytest.mark.parametrize(("field", "value"), BAD)
@pytest.mark.parametrize("endpoint", ["completion", "oai_completion", "chat"])
def test_invalid_values_are_400_naming_the_field(patched: LlamaServer, endpoint: str, field: str, value: Any) -> None:
    c = patched.client
    body: dict[str, Any] = {"shared_pool_slot": 1, "shared_prefix_n_tokens": 5, field: value}
    call = getattr(c, endpoint)
    first = [{"role": "user", "content": "hi"}] if endpoint == "chat" else "hi"
    with pytest.raises(HTTPError) as info:
        call(first, max_tokens=1, **body)
    assert info.value.status == 400
    assert field in info.value.server_message


def test_null_means_absent(pc: Client) -> None:
    res = pc.completion("hi", shared_pool_slot=None, shared_prefix_n_tokens=None, n_predict=1)
    assert "shared_prefix" not in res


# ------------------------------------------------------------------------------ reporting


def test_report_in_streams_and_oai_endpoints(pc: Client) -> None:
    prompt = BASE + QUESTIONS[0]
    p = pc.shared_prefix_len(BASE, prompt)
    pc.prime(BASE, 0)
    st = pc.completion_stream(prompt, share=Share(0, p), id_slot=1, n_predict=6, temperature=0)
    assert st.chunks[-1]["shared_prefix"]["status"] == "hit"
    assert not any("shared_prefix" in ch for ch in st.chunks[:-1])

    oai = pc.oai_completion(prompt, share=Share(0, p), id_slot=2, max_tokens=6, temperature=0)
    assert oai["shared_prefix"]["status"] == "hit"
    ost = pc.oai_completion_stream(prompt, share=Share(0, p), id_slot=3, max_tokens=6, temperature=0)
    assert ost.chunks[-1]["shared_prefix"]["status"] == "hit"
    assert not any("shared_prefix" in ch for ch in ost.chunks[:-1])

    erase_all(pc)
    pool_msgs = [{"role": "system", "content": BASE}]
    msgs = [*pool_msgs, {"role": "user", "content": "What does fact 3 say?"}]
    pc_ = pc.shared_prefix_len(pc.apply_template(pool_msgs), pc.apply_template(msgs))
    pc.prime(pc.apply_template(pool_msgs), 0)
    chat = pc.chat(msgs, share=Share(0, pc_), id_slot=1, max_tokens=6, temperature=0)
    assert chat["shared_prefix"] == {"pool_slot": 0, "requested": pc_, "shared": pc_, "status": "hit"}
    assert chat["timings"]["prompt_n"] == chat["usage"]["prompt_tokens"] - pc_
    cst = pc.chat_stream(
        msgs,
        share=Share(0, pc_),
        id_slot=2,
        max_tokens=6,
        temperature=0,
        stream_options={"include_usage": True},
    )
    assert cst.chunks[-1]["shared_prefix"]["status"] == "hit"
    assert not any("shared_prefix" in ch for ch in cst.chunks[:-1])


def test_metrics(pc: Client) -> None:
    before = pc.metrics()
    prompt = BASE + QUESTIONS[1]
    p = pc.shared_prefix_len(BASE, prompt)
    pc.prime(BASE, 0)
    share(pc, prompt, p)
    share(pc, prompt, p + 50, slot=2)  # not_resident
    after = pc.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("llamacpp:polykv_share_requests_total") == 2
    assert delta("llamacpp:polykv_share_hits_total") == 1
    assert delta("llamacpp:polykv_share_misses_total") == 1
    assert delta("llamacpp:polykv_shared_tokens_total") == p
    assert delta('llamacpp:polykv_share_outcomes_total{status="not_resident"}') == 1


# ------------------------------------------------------------------------------ default path


def test_without_fields_identical_to_reference(pc: Client, rc: Client) -> None:
    msgs = [{"role": "system", "content": BASE}, {"role": "user", "content": "What does fact 3 say?"}]

    def session(c: Client) -> list[Any]:
        out: list[Any] = [c.prime(BASE, 0)]
        out.append(c.completion(BASE + QUESTIONS[0], id_slot=1, **GEN))
        out.append(c.completion(BASE + QUESTIONS[1], **GEN))
        out.append(c.oai_completion(BASE + QUESTIONS[2], max_tokens=6, temperature=0, logprobs=2))
        out.append(c.chat(msgs, max_tokens=6, temperature=0))
        out.append(c.completion_stream(BASE + QUESTIONS[0], id_slot=2, **GEN).chunks)
        out.append(c.chat_stream(msgs, max_tokens=6, temperature=0, stream_options={"include_usage": True}).chunks)
        return out

    got, ref = session(pc), session(rc)
    same, difference = compare(got, ref)  # only the volatile fields removed, as in the gate
    assert same, difference
    assert "shared_prefix" not in repr(got)


# ------------------------------------------------------------------------------ other server configurations


def test_default_idle_caching_evicts_pool_not_resident(
    patched_server_bin: Path, upstream_server_bin: Path, model_path: Path, logs: Path
) -> None:
    """Without --no-clear-idle the sharer's own launch clears the idle pool: refused, and correct."""
    prompt = BASE + QUESTIONS[0]
    with start(patched_server_bin, model_path, [UNIFIED_KV], logs, "patched-default") as srv:
        c = srv.client
        p = c.shared_prefix_len(BASE, prompt)
        c.prime(BASE, 0)
        got = share(c, prompt, p)
        assert got["shared_prefix"]["status"] == "not_resident"
        assert got["timings"]["prompt_n"] == len(c.prompt_tokens(prompt))
    with start(upstream_server_bin, model_path, [UNIFIED_KV], logs, "upstream-default") as srv:
        srv.client.prime(BASE, 0)
        ref = srv.client.completion(prompt, id_slot=1, **GEN)
    same_answer(got, ref)


def test_non_unified_kv_copies_whole_sequence(
    patched_server_bin: Path, upstream_server_bin: Path, model_path: Path, logs: Path
) -> None:
    """-np without -kvu: one stream per slot. A partial seq_cp would abort; the server copies and trims."""
    prompt = BASE_NN + QUESTIONS[0].lstrip("\n")
    with start(patched_server_bin, model_path, [NO_CLEAR_IDLE], logs, "patched-streams") as srv:
        c = srv.client
        p = c.shared_prefix_len(BASE_NN, prompt)
        c.completion(BASE_NN, id_slot=0, n_predict=4, temperature=0)  # pool longer than P
        got = share(c, prompt, p)
        assert got["shared_prefix"] == {"pool_slot": 0, "requested": p, "shared": p, "status": "copied"}
        assert got["timings"]["prompt_n"] == len(c.prompt_tokens(prompt)) - p
        for slot in (2, 3):  # more sharers, and a bad P: the server must survive all of them
            more = share(c, prompt, p, slot=slot)
            assert more["shared_prefix"]["status"] == "copied"
            same_answer(more, got)  # each slot's own stream, copied from the pool's: the same layout, bit-exact
        assert share(c, prompt, p + 1, slot=1)["shared_prefix"]["status"] in ("own_cache", "mismatch")
        assert srv.is_alive() and srv.health_state() == "ok"
    with start(upstream_server_bin, model_path, [NO_CACHE_IDLE], logs, "upstream-streams") as srv:
        rc = srv.client
        rc.completion(BASE_NN, id_slot=0, n_predict=4, temperature=0)
        ref = rc.completion(prompt, id_slot=0, **GEN)
    same_answer(got, ref)

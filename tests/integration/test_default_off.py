"""Default off: without the pool fields the patched server answers byte for byte like the reference.

The gate (``default_output``) checks this with unified KV (``-kvu``). Here the other two ways a
user meets the patched binary:

- **stock defaults**: only ``-np N -c C`` (one KV stream per slot, upstream's host prompt cache and
  idle-slot caching on, no ``--metrics``), with a session that goes through the host prompt cache;
- **a reserved pool nobody uses**: ``--pool-slots 0`` on the patched server, the same other flags
  on both, no request naming slot 0 or setting a pool field.

Both servers get the same requests (a session through the host prompt cache, then the gate's
default-output set; with the reserved pool the gate's set alone, every request pinned), and their
answers are compared after removing only :data:`polykv_py.harness.answers.VOLATILE_FIELDS`.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from polykv_py.harness.answers import VOLATILE_FIELDS, Answer, compare
from polykv_py.harness.gate import Case, default_output_cases, run_cases
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import pool_slot_args, slots_args

pytestmark = pytest.mark.integration

N_SLOTS = 4
CTX = 4096
N_PREDICT = 6

#: polykv's counters in ``/metrics`` and when they appear, as the code does it today
#: (polykv_write_metrics() in native/server/server-polykv.cpp, patch 0074; docs/shared-prefix.md "Metrics"):
#: without ``--pool-slots`` none of them until a request sets ``shared_pool_slot`` (upstream's names exactly);
#: with ``--pool-slots`` (or ``--share-any``) these eight from the start, each 0 while nobody shares ...
POLYKV_COUNTERS = {
    "llamacpp:polykv_share_requests_total",
    "llamacpp:polykv_share_auto_total",
    "llamacpp:polykv_share_any_total",
    "llamacpp:polykv_share_promoted_total",
    "llamacpp:polykv_share_waits_total",
    "llamacpp:polykv_share_hits_total",
    "llamacpp:polykv_share_misses_total",
    "llamacpp:polykv_shared_tokens_total",
}
#: ... and the per-status counter only once a request has opted in (one series per status seen).
POLYKV_OUTCOMES = "llamacpp:polykv_share_outcomes_total"

#: A text long enough for the host prompt cache to matter (about 190 tokens).
LONG = "Inventory of the north warehouse.\n" + "\n".join(
    f"Shelf {i}: {3 * i + 1} boxes of {('bolts', 'nails', 'screws', 'hinges', 'washers')[i % 5]}, "
    f"checked on day {i % 28 + 1}."
    for i in range(12)
)


OTHERS = ("Name a color:", "Write one word about rain:", "Give a number between 3 and 9:", "Translate cat into French:")


def host_cache_session() -> list[Case]:
    """Unpinned requests that make a slot drop LONG for other prompts, then ask about LONG again.

    The last request finds LONG in no slot and restores it from the host prompt cache (upstream saves a
    slot's prompt there when the slot is picked for another one, and saves idle slots when a task starts).
    It runs first, on fresh servers: the least-recently-used slot is then the same on both (after
    concurrent requests it depends on when each arrived, on the reference as much as on the patched server).
    """
    greedy: dict[str, Any] = {"n_predict": N_PREDICT, "temperature": 0.0, "n_probs": 2, "cache_prompt": True}
    cases = [Case("long/first", "/completion", {"prompt": LONG + "\nQuestion: what is on shelf 4?", **greedy})]
    # as many as the slots (the last one evicts LONG), none starting like another (else the slot-similarity
    # rule would keep them all in one slot)
    for i, prompt in enumerate(OTHERS):
        cases.append(Case(f"other/{i}", "/completion", {"prompt": prompt, **greedy}))
    cases.append(Case("long/again", "/completion", {"prompt": LONG + "\nQuestion: what is on shelf 7?", **greedy}))
    return cases


def pinned(cases: list[Case]) -> list[Case]:
    """``cases`` with every request pinned to an agent slot (1..N-1): nothing runs on the reserved slot 0."""
    out = []
    for i, case in enumerate(cases):
        body = copy.deepcopy(case.body)
        body.setdefault("id_slot", 1 + i % (N_SLOTS - 1))
        out.append(dataclasses.replace(case, body=body))
    return out


def session(
    binary: Path, model: Path, args: list[str], cases: list[Case], logs: Path, name: str, *, metrics: bool
) -> tuple[dict[str, Answer], dict[str, float], list[Any]]:
    """Start a server, send ``cases``; its answers, its ``/metrics`` (if on) and its ``/slots`` (if on)."""
    with LlamaServer(binary, model, args, metrics=metrics, log_dir=logs, name=name) as srv:
        answers = run_cases(srv, cases)
        assert srv.is_alive()
        return answers, srv.client.metrics() if metrics else {}, srv.client.slots() if "--slots" in args else []


def assert_identical(patched: dict[str, Answer], reference: dict[str, Answer], cases: list[Case]) -> None:
    assert list(patched) == list(reference) == [c.name for c in cases]
    diffs = {}
    for case in cases:
        same, diff = compare(patched[case.name], reference[case.name], VOLATILE_FIELDS, VOLATILE_FIELDS)
        if not same:
            diffs[case.name] = diff
    assert not diffs, diffs
    assert "shared_prefix" not in repr(patched)


def names(metrics: dict[str, float]) -> set[str]:
    """Metric names without their labels."""
    return {key.partition("{")[0] for key in metrics}


def test_stock_defaults_identical_to_reference(
    patched_server_bin: Path, upstream_server_bin: Path, model_path: Path, tmp_path: Path
) -> None:
    """``-np 4 -c 4096`` and nothing else: one KV stream per slot, host prompt cache and idle-slot caching on."""
    cases = host_cache_session() + default_output_cases(N_PREDICT, 2)
    args = slots_args(N_SLOTS, CTX)
    got, _, _ = session(patched_server_bin, model_path, args, cases, tmp_path, "stock-patched", metrics=False)
    ref, _, _ = session(upstream_server_bin, model_path, args, cases, tmp_path, "stock-reference", metrics=False)
    assert_identical(got, ref, cases)
    # the session went through the host prompt cache: LONG was restored from RAM, not recomputed
    again = got["long/again"]
    assert isinstance(again, dict) and again["timings"]["cache_n"] > 150, again["timings"]


def test_unused_pool_slots_identical_to_reference(
    patched_server_bin: Path, upstream_server_bin: Path, model_path: Path, tmp_path: Path
) -> None:
    """``--pool-slots 0`` set and never used: the same answers, and the same metrics but polykv's counters.

    Every request is pinned to an agent slot: an unpinned request is never scheduled onto a reserved slot
    (docs/shared-prefix.md, "Reserved pools"), so where the reference would pick slot 0 the patched server
    picks another, and ``id_slot``, ``cache_n`` and what follows would differ by design.
    """
    cases = pinned(default_output_cases(N_PREDICT, 2))
    args = [*slots_args(N_SLOTS, CTX), "--slots"]
    reserved = [*args, *pool_slot_args([0])]
    got, got_metrics, got_slots = session(
        patched_server_bin, model_path, reserved, cases, tmp_path, "unused-pool-patched", metrics=True
    )
    ref, ref_metrics, ref_slots = session(
        upstream_server_bin, model_path, args, cases, tmp_path, "unused-pool-reference", metrics=True
    )
    assert_identical(got, ref, cases)

    # /metrics with --pool-slots: the reference's names, plus polykv's five counters (all 0); no per-status one
    assert names(got_metrics) - names(ref_metrics) == POLYKV_COUNTERS
    assert names(ref_metrics) <= names(got_metrics)
    assert {name: got_metrics[name] for name in POLYKV_COUNTERS} == dict.fromkeys(POLYKV_COUNTERS, 0.0)
    assert POLYKV_OUTCOMES not in names(got_metrics)
    for counter in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"):
        assert got_metrics[counter] == ref_metrics[counter], counter

    # /slots: the same, except the reserved slot's "polykv_pool": true (and each slot's last task id: ids are
    # handed out in arrival order, which the concurrent requests race for on either server)
    assert [s.get("polykv_pool", False) for s in got_slots] == [True, False, False, False]
    got_slots[0].pop("polykv_pool")
    # ... and its "polykv_pool_state" (patch 0075): never used, so empty and never hit
    state = got_slots[0].pop("polykv_pool_state")
    assert (state["resident"], state["n_tokens"], state["hits"], state["sharers"]) == (False, 0, 0, 0)
    assert not any("polykv_pool_state" in s for s in got_slots[1:])
    same, diff = compare(got_slots, ref_slots, (*VOLATILE_FIELDS, "id_task"), (*VOLATILE_FIELDS, "id_task"))
    assert same, diff


def test_metrics_without_pool_slots_are_upstreams_until_an_opt_in(
    patched_server_bin: Path, upstream_server_bin: Path, model_path: Path, tmp_path: Path
) -> None:
    """``--metrics`` without ``--pool-slots``: the reference's metric names exactly, until a request opts in."""
    args = slots_args(2, 2048)
    cases = [Case("plain", "/completion", {"prompt": OTHERS[0], "n_predict": 2, "temperature": 0.0})]
    with LlamaServer(patched_server_bin, model_path, args, log_dir=tmp_path, name="metrics-patched") as srv:
        answers = run_cases(srv, cases)
        before = srv.client.metrics()
        opted = srv.client.completion(OTHERS[1], shared_pool_slot=0, shared_prefix_n_tokens=4, n_predict=2)
        after = srv.client.metrics()
    ref, ref_metrics, _ = session(upstream_server_bin, model_path, args, cases, tmp_path, "metrics-ref", metrics=True)
    assert_identical(answers, ref, cases)
    assert names(before) == names(ref_metrics)
    # one request set shared_pool_slot (the pool slot 0 holds nothing: not_resident): now the counters, and its status
    assert opted["shared_prefix"]["status"] == "not_resident"
    assert names(after) - names(ref_metrics) == POLYKV_COUNTERS | {POLYKV_OUTCOMES}
    assert after['llamacpp:polykv_share_outcomes_total{status="not_resident"}'] == 1
    assert after["llamacpp:polykv_share_requests_total"] == after["llamacpp:polykv_share_misses_total"] == 1

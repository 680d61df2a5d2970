"""The shared-prefix decode attention (patch 0076) on a real server: answers as with it off.

Two patched servers that differ only in ``--shared-decode`` run the same 12 rounds of 16 agents
over one pool (every agent ``hit``, or ``own_cache`` once its slot holds the pool's cells; 16
greedy tokens, ``n_probs`` 20). Each round is one multi-prompt ``/completion``: the server queues
its 16 tasks together, so both servers put every agent in the same slot and cells and batch the
same rows (one suffix batch, then one decode batch of all 16 per step); the test checks that
slots and token counts match. The comparison is like for like: two runs of the server without
the option answer byte for byte alike (measured: 192 of 192), so all that differs here is the
attention's rounding (f32 scores and accumulators instead of f16 Q and an f16 accumulator).

So no answer may be ``different`` under :data:`~polykv_py.harness.compare.LAYOUT` margins, no
answer may stay byte-identical (that would mean the path left it alone), and ``/props`` must
count one op per layer for every decode batch of the rounds on one server and nothing on the other.
(Agents sent one by one, as a fan-out does, batch as they arrive; that noise is measured in
docs/shared-decode.md: between two runs of the same recipe up to 1 in 192 agents crossed the margin.)
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.multiturn import question_block
from polykv_py.client import Share
from polykv_py.data import sample_document
from polykv_py.harness.answers import compare
from polykv_py.harness.compare import LAYOUT, Comparison, compare_steps, steps_from_probs
from polykv_py.presets import SHARED_DECODE, pool_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # 192 agents on each of two servers

log = logging.getLogger(__name__)

N_AGENTS = 16
ROUNDS = 12  # 192 agents per server
#: n_probs 20, not 5: this small model's distribution is often flat, and at a flip the comparator must see
#: the other run's pick among the candidates (a fresh-clone CI run once had a pick 6th or lower in the
#: other run: "gap inf" with 5; over 384 agents with 20 the largest gap at a flip was 0.32)
GEN = {"n_predict": 16, "temperature": 0.0, "n_probs": 20, "ignore_eos": True}
#: the default model's layers: the path counts one op per layer and batch
N_LAYER = 30
#: what must match between the two servers for the comparison to be like for like
LAYOUT_FIELDS = ("id_slot", "tokens_cached", "shared_prefix")


@dataclass(frozen=True)
class Run:
    """One server's answers per round, and its ``/props`` after the prime and at the end."""

    rounds: list[list[dict[str, Any]]]
    props_primed: dict[str, Any]
    props: dict[str, Any]


def rounds_on(extra: list[str], log_dir: Path) -> Run:
    """Every round on one fresh server, each round's agents in one multi-prompt request."""
    srv = pool_server(n_agents_parallel=N_AGENTS, ctx=8192, threads=2, extra_args=extra, track_kv=False,
                      log_dir=log_dir, name="shared-decode" if extra else "shared-decode-off")  # fmt: skip
    base = sample_document()
    out: list[list[dict[str, Any]]] = []
    with srv:
        c = srv.client
        c.prime(base, 0)
        primed = c.props()
        for r in range(ROUNDS):
            res = c.completion([base + question_block(i, r)[0] for i in range(N_AGENTS)], share=Share(0), **GEN)
            assert isinstance(res, list) and len(res) == N_AGENTS, res
            # round 0 shares the pool; later rounds find its cells still in their slots (own_cache)
            statuses = [a["shared_prefix"]["status"] for a in res]
            assert set(statuses) == ({"hit"} if r == 0 else {"own_cache"}), statuses
            assert all(a["timings"]["prompt_n"] < 64 for a in res), [a["timings"] for a in res]
            out.append(res)
        return Run(out, primed, c.props())


Runs = dict[str, Run]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp = tmp_path_factory.mktemp("shared-decode")
    return {"off": rounds_on([], tmp), "on": rounds_on([SHARED_DECODE], tmp)}


def pairs(runs: Runs) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(answer off, answer on) for every agent of every round."""
    out = []
    for off_round, on_round in zip(runs["off"].rounds, runs["on"].rounds, strict=True):
        out += list(zip(off_round, on_round, strict=True))
    assert len(out) == N_AGENTS * ROUNDS
    return out


def comparisons(runs: Runs) -> list[Comparison]:
    """Each agent's answer with the path on against the same agent's with it off."""
    return [
        compare_steps(
            steps_from_probs(a["completion_probabilities"]),
            steps_from_probs(b["completion_probabilities"]),
            margins=LAYOUT,
        )
        for a, b in pairs(runs)
    ]


def test_both_servers_lay_the_agents_out_alike(runs: Runs) -> None:
    for i, (a, b) in enumerate(pairs(runs)):
        off = [a.get(k) for k in LAYOUT_FIELDS] + [a["timings"]["prompt_n"], a["timings"]["cache_n"]]
        on = [b.get(k) for k in LAYOUT_FIELDS] + [b["timings"]["prompt_n"], b["timings"]["cache_n"]]
        assert off == on, f"agent {i} (round {i // N_AGENTS}): {LAYOUT_FIELDS}, prompt_n and cache_n differ"


def test_answers_match_the_server_without_it(runs: Runs) -> None:
    cmps = comparisons(runs)
    verdicts = Counter(c.verdict for c in cmps)
    gaps = [c.tie_gap for c in cmps if c.tie_gap is not None]
    log.warning("shared decode on vs off over %d agents: %s; max drift %.4f, largest gap at a flip %.4f", len(cmps),
                dict(verdicts), max(c.max_drift for c in cmps), max(gaps, default=0.0))  # fmt: skip
    # Like for like, the path's rounding is all that differs. Measured here (2-core AMD EPYC, AVX-512; the
    # batching is deterministic: two runs of each server answered byte-identically, and two more test runs
    # counted the same): 106 identical / 86 near tie / 0 different, max drift 0.33, largest gap at a flip 0.37
    # (LAYOUT: 0.5, 1.0). Even with agents sent concurrently (another layout per run) on vs off measured 0
    # different in 8 pairs (max drift 0.38).
    assert [c.detail for c in cmps if not c.ok] == []
    # Most flips are near ties and a minority: 106 of 192 identical here; 97-116 in on-vs-off pairs where one
    # or both sent the agents concurrently (8 pairs, AMD EPYC). Half leaves room for another CPU's rounding.
    assert verdicts["identical"] >= len(cmps) // 2, verdicts
    # the path computes every agent's attention: each answer's log-probabilities moved (measured: 192 of 192)
    same = [i for i, (a, b) in enumerate(pairs(runs)) if compare(a, b)[0]]
    assert same == [], f"agents answered byte-identically with the path on: {same}"


def test_the_path_ran_only_where_it_was_turned_on(runs: Runs) -> None:
    on, primed = runs["on"].props["polykv_shared_decode"], runs["on"].props_primed["polykv_shared_decode"]
    assert on["enabled"] is True, on
    # one op per layer for each round's suffix batch and each decode step but the last (its token is not decoded)
    assert on["ops"] - primed["ops"] == N_LAYER * ROUNDS * GEN["n_predict"], (primed, on)
    assert on["tiles_shared"] > primed["tiles_shared"] and on["tiles_private"] > primed["tiles_private"], (primed, on)
    assert "polykv_shared_decode" not in runs["off"].props


def test_the_path_counts_its_time_and_work(runs: Runs) -> None:
    on, primed = runs["on"].props["polykv_shared_decode"], runs["on"].props_primed["polykv_shared_decode"]
    t = {k: on["time"][k] - primed["time"][k] for k in on["time"]}
    assert all(v > 0 for v in t.values()), t
    # the threads' time by tile kind lies within their work items, and the items within the nodes' wall time on
    # each of the 2 threads (thread 0 times a node from before its first barrier to its last row)
    assert t["shared_ns"] + t["private_ns"] <= t["items_ns"] <= 2 * t["node_ns"], t
    # 2 (DK + DV) flops per query head of a visible (token, cell) pair: the 3 query heads of each of the 3 KV heads
    pair_flop = 2 * (64 + 64) * 9
    assert t["shared_flop"] % pair_flop == 0 and t["private_flop"] % pair_flop == 0, t
    # a private pair's K and V rows: 3 KV heads of 64 f16 values each
    assert t["private_bytes"] == t["private_flop"] // pair_flop * 3 * 2 * 64 * 2, t

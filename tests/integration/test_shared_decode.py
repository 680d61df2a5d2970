"""The shared-prefix decode attention (patch 0076) on a real server: answers as with it off.

Two patched servers that differ only in ``--shared-decode`` run the same rounds of 16 agents
over one pool (every agent ``hit``, or ``own_cache`` once its slot holds the pool's cells; all 16
decoding together, so every decode step is a batch of 16 rows over the pool's cells). The path
changes float rounding (f32 scores and accumulators instead of f16 Q and an f16 accumulator), the
way cell layout already does, so the answers are compared with
:data:`~polykv_py.harness.compare.LAYOUT` margins over ``n_probs`` 20: ``different`` no more often
than between two runs of the same server (at most 1%); the counts are logged. The counters of
``/props`` show that the path ran on one server and not on the other.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench.multiturn import question_block
from polykv_py.client import AsyncClient
from polykv_py.data import sample_document
from polykv_py.fanout import Agent, BaseContext, SharedContext
from polykv_py.harness.compare import LAYOUT, Comparison, compare_steps, steps_from_probs
from polykv_py.presets import pool_server
from polykv_py.results import AgentResult

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # 192 agents on each of two servers

log = logging.getLogger(__name__)

N_AGENTS = 16
ROUNDS = 12  # 192 agents per server
#: n_probs 20, not 5: this small model's distribution is often flat, and at a flip the comparator must see
#: the other run's pick among the candidates (a fresh-clone CI run once had a pick 6th or lower in the
#: other run: "gap inf" with 5; over 384 agents with 20 the largest gap at a flip was 0.32)
GEN = {"n_predict": 16, "temperature": 0.0, "n_probs": 20, "ignore_eos": True}


def rounds_on(extra: list[str], log_dir: Path) -> tuple[list[list[AgentResult]], dict[str, Any]]:
    """Every round on one fresh server; its ``/props`` at the end."""
    srv = pool_server(n_agents_parallel=N_AGENTS, ctx=8192, threads=2, extra_args=extra, log_dir=log_dir,
                      name="shared-decode" if extra else "shared-decode-off")  # fmt: skip

    async def go() -> tuple[list[list[AgentResult]], dict[str, Any]]:
        out = []
        async with AsyncClient(srv.url) as client:
            sc = SharedContext(client, BaseContext.from_text(sample_document()), concurrency=N_AGENTS)
            for r in range(ROUNDS):
                agents = [Agent(question_block(i, r)[0], name=f"r{r}a{i}", mode="completion", params=GEN)
                          for i in range(N_AGENTS)]  # fmt: skip
                res = await sc.run(agents)
                # round 0 shares the pool; later rounds find its cells still in their slots (own_cache)
                assert all(a.prefix_reused and a.processed < 64 for a in res.agents), res.statuses
                out.append(res.agents)
            return out, await client.props()

    with srv:
        return asyncio.run(go())


Runs = dict[str, tuple[list[list[AgentResult]], dict[str, Any]]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp = tmp_path_factory.mktemp("shared-decode")
    return {"off": rounds_on([], tmp), "on": rounds_on(["--shared-decode"], tmp)}


def comparisons(runs: Runs) -> list[Comparison]:
    out = []
    for off_round, on_round in zip(runs["off"][0], runs["on"][0], strict=True):
        for a, b in zip(off_round, on_round, strict=True):
            assert a.probs and b.probs, "the agents ask for n_probs"
            out.append(compare_steps(steps_from_probs(a.probs), steps_from_probs(b.probs), margins=LAYOUT))
    return out


def test_answers_match_the_server_without_it(runs: Runs) -> None:
    cmps = comparisons(runs)
    verdicts = Counter(c.verdict for c in cmps)
    log.warning("shared decode on vs off over %d agents: %s; max drift %.4f", len(cmps), dict(verdicts),
                max(c.max_drift for c in cmps))  # fmt: skip
    assert len(cmps) == N_AGENTS * ROUNDS
    # Run-to-run noise sets the bar: the server batches concurrent agents as they arrive, so two runs of
    # the *same* recipe lay cells out and batch rows differently. Measured here over 192 agents each:
    # off vs off 108 identical / 84 near tie / 0 different (max drift 0.32); on vs on 141 / 50 / 1 (one
    # token drifted 0.54, over LAYOUT's 0.5); on vs off 124 / 68 / 0 and 109 / 83 / 0 (max 0.34). So at
    # most 1% may cross the margin, as between two runs of one recipe; more would be the path's doing.
    bad = [c.detail for c in cmps if not c.ok]
    assert len(bad) <= len(cmps) // 100, bad[:5]
    assert verdicts["identical"] >= len(cmps) * 2 // 5, verdicts  # most flips are near ties, and a minority


def test_the_path_ran_only_where_it_was_turned_on(runs: Runs) -> None:
    on = runs["on"][1]["polykv_shared_decode"]
    assert isinstance(on, dict) and on["enabled"] is True
    # one op per layer (30) per batch of 2-511 tokens: most of each round's 16 decode steps batch all agents
    assert on["ops"] >= 30 * (GEN["n_predict"] // 2) * ROUNDS, on
    assert on["tiles_shared"] > 0 and on["tiles_private"] > 0, on
    off = runs["off"][1].get("polykv_shared_decode")
    assert off is None or (off["enabled"] is False and off["ops"] == 0), off

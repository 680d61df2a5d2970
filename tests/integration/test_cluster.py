"""Replicas behind the real gateway (smg): pool affinity, answers, and a replica killed mid fan-out.

3 patched replicas (1 thread, small contexts, 3 pool slots each) behind ``smg launch --policy
manual``; 12 agents over 3 bases through :class:`~polykv_py.routing.RoutedFanout`. Loopback only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from polykv_py.client import AsyncClient
from polykv_py.cluster import Cluster, ClusterConfig
from polykv_py.fanout import Agent, BasePrompt, Fanout
from polykv_py.harness.compare import LAYOUT, compare_steps, steps_from_probs
from polykv_py.pools import PoolCache, pool_states
from polykv_py.prefix_file import tokens_sha256
from polykv_py.presets import serve_server
from polykv_py.results import AgentResult, FanoutResult
from polykv_py.routing import RoutedFanout, Router

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # 3 replicas and the gateway, plus a single server

CITIES = ("Arden", "Brisk", "Corvale")
BASES = [
    "\n".join(f"Record {i}: in {city}, warehouse {i} holds {(i * 7 + k * 13) % 97} crates of tin." for i in range(40))
    for k, city in enumerate(CITIES)
]
QUESTIONS = [f"\nQuestion: how many crates does warehouse {w} hold? Answer:" for w in (3, 11, 26, 38)]
GEN = {"n_predict": 12, "temperature": 0.0, "n_probs": 5}
CONFIG = ClusterConfig(replicas=3, pools_per_replica=3, agent_slots=8, ctx=12288, threads=1)


def agents(n_predict: int = 12) -> list[Agent]:
    return [Agent(q, name=f"q{i}", params={**GEN, "n_predict": n_predict}) for i, q in enumerate(QUESTIONS)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    with Cluster(CONFIG, pool_cache=PoolCache(tmp / "pools"), log_dir=tmp) as c:
        yield c


async def fan_out_all(router: Router, contexts: list[RoutedFanout], n_predict: int = 12) -> list[FanoutResult]:
    return list(await asyncio.gather(*(ctx.run(agents(n_predict)) for ctx in contexts)))


def contexts_for(router: Router, cluster: Cluster) -> list[RoutedFanout]:
    return [router.context(BasePrompt.from_text(b), concurrency=4, pool_cache=cluster.pool_cache) for b in BASES]


@pytest.fixture(scope="module")
def single_server_answers(tmp_path_factory: pytest.TempPathFactory) -> list[list[AgentResult]]:
    """The same fan-outs on one replica-shaped server, without the gateway."""
    tmp = tmp_path_factory.mktemp("single")
    srv = serve_server(3, agent_slots=8, ctx=12288, threads=1, slot_actions=True, log_dir=tmp)

    async def go() -> list[list[AgentResult]]:
        out = []
        async with AsyncClient(srv.url) as client:
            for slot, base in enumerate(BASES):
                ctx = Fanout(client, BasePrompt.from_text(base), pool_slot=slot, concurrency=4)
                res = await ctx.run(agents())
                assert all(a.status == "hit" for a in res.agents), res.statuses
                out.append(res.agents)
        return out

    with srv:
        return asyncio.run(go())


def assert_same_answers(got: list[AgentResult], want: list[AgentResult]) -> None:
    """Every answer is the single server's, up to measured layout rounding (a near tie may flip a token;
    the cells of other agents and bases sit elsewhere on a replica): never ``different``."""
    for a, b in zip(got, want, strict=True):
        assert a.probs and b.probs, "the agents ask for n_probs"
        sa, sb = steps_from_probs(a.probs), steps_from_probs(b.probs)
        n = min(len(sa), len(sb))
        cmp = compare_steps(sa[:n], sb[:n], margins=LAYOUT)
        assert cmp.ok, (a.name, cmp.detail, a.text, b.text)


def test_each_base_sticks_to_one_replica_and_every_agent_shares(
    cluster: Cluster, single_server_answers: list[list[AgentResult]]
) -> None:
    async def go() -> tuple[list[FanoutResult], list[str | None], list[int]]:
        async with cluster.router() as router:
            ctxs = contexts_for(router, cluster)
            results = await fan_out_all(router, ctxs)
            return results, [c.home for c in ctxs], [c.pool_slot for c in ctxs]

    results, homes, slots = asyncio.run(go())
    for k, res in enumerate(results):
        assert {a.replica for a in res.agents} == {homes[k]}, (k, [a.replica for a in res.agents], homes[k])
        assert [a.status for a in res.agents] == ["hit"] * 4, res.statuses
        assert_same_answers(res.agents, single_server_answers[k])
        assert len(res.primes) == 1 and res.primes[0].processed > 0
    # the replicas' own view: each base's pool on its home replica, shared by its 4 agents and nothing else
    by_url = {r.url: r for r in cluster.replicas}
    for k, base in enumerate(BASES):
        srv = by_url[homes[k]]
        toks = srv.client.prompt_tokens(base)
        (pool,) = [p for p in pool_states(srv.client.slots()) if p.slot == slots[k]]
        assert pool.tokens_sha256 == tokens_sha256(toks) and pool.hits == 4
        others = [r for r in cluster.replicas if r.url != homes[k]]
        for r in others:
            assert all(p.tokens_sha256 != tokens_sha256(toks) for p in pool_states(r.client.slots()) if p.n_tokens)
    shares = sum(int(r.client.metrics().get("llamacpp:polykv_share_requests_total", 0)) for r in cluster.replicas)
    assert shares == 12


def test_a_killed_replica_moves_only_its_bases_and_comes_back(
    cluster: Cluster, single_server_answers: list[list[AgentResult]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="polykv_py.routing")

    async def go() -> dict[str, object]:
        async with cluster.router() as router:
            ctxs = contexts_for(router, cluster)
            for ctx in ctxs:
                await ctx.ensure_home()
            homes = [c.home for c in ctxs]
            victim_url = homes[0]
            victim = next(i for i, r in enumerate(cluster.replicas) if r.url == victim_url)
            moved_before = [len(c.moves) for c in ctxs]

            async def kill_soon() -> None:
                await asyncio.sleep(1.0)  # the first answers are being generated
                await asyncio.to_thread(cluster.kill, victim)

            killer = asyncio.ensure_future(kill_soon())
            results = await fan_out_all(router, ctxs, n_predict=48)
            await killer
            after_kill = [c.home for c in ctxs]
            moves = [c.moves[n:] for c, n in zip(ctxs, moved_before, strict=True)]
            # the replica comes back: the gateway routes its keys to it again, and their pools follow
            await asyncio.to_thread(cluster.restart, victim)
            back = await fan_out_all(router, ctxs)
            return {
                "homes": homes, "victim": victim_url, "results": results, "after_kill": after_kill,
                "moves": moves, "back": back, "homes_back": [c.home for c in ctxs],
            }  # fmt: skip

    out = asyncio.run(go())
    homes, victim = out["homes"], out["victim"]
    assert isinstance(homes, list) and isinstance(victim, str)
    on_victim = [k for k, h in enumerate(homes) if h == victim]
    for k, res in enumerate(out["results"]):  # type: ignore[arg-type]
        assert not [a.error for a in res.agents if a.error], (k, [a.error for a in res.agents])
        # nobody got another pool's KV, and every answer is the one a single server gives
        assert_same_answers(res.agents, single_server_answers[k])
    after_kill = out["after_kill"]
    assert isinstance(after_kill, list)
    for k in range(len(BASES)):
        if k in on_victim:
            assert after_kill[k] != victim and out["moves"][k], (k, out["moves"][k])  # type: ignore[index]
        else:
            assert after_kill[k] == homes[k] and not out["moves"][k]  # type: ignore[index]
    # the failure was reported naming the replica
    assert any(victim in r.getMessage() and "failed" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    # back: its keys return to it, their pools are placed there again (restored from the pool cache)
    assert out["homes_back"] == homes
    for k, res in enumerate(out["back"]):  # type: ignore[arg-type]
        assert {a.replica for a in res.agents} == {homes[k]}
        assert_same_answers(res.agents, single_server_answers[k])

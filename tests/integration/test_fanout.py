"""The fan-out API on the real patched llama-server and the default model (kept cheap: 2 threads,
a ~400-token base, 3 agents, at most 12 generated tokens)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polykv_py.client import AsyncClient
from polykv_py.data import sample_document
from polykv_py.fanout import Agent, BasePrompt, Fanout
from polykv_py.harness.kvcells import KVCellsLog
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import pool_server
from polykv_py.results import FanoutResult
from polykv_py.tokens import common_prefix_len

pytestmark = pytest.mark.integration

N_PREDICT = 12
QUESTIONS = ["What does Lanternfish replace?", "How many bikes does the fleet have?", "Name one goal."]


def base_text() -> str:
    # ends with a blank line: alone, "\n\n" is one token; followed by an agent's text it is two
    text = "\n".join(sample_document().splitlines()[:24])
    return text.rstrip("\n") + "\n\n"


@pytest.fixture(scope="module")
def server(patched_server_bin: Path, model_path: Path) -> Iterator[LlamaServer]:
    srv = pool_server(n_agents_parallel=3, ctx=4096, threads=2, name="fanout-test")
    with srv:
        yield srv


def fanout(server: LlamaServer, base: BasePrompt, agents: list[Agent], **kw: Any) -> tuple[FanoutResult, dict]:
    async def main() -> tuple[FanoutResult, dict]:
        async with AsyncClient(server.url, server=server) as client:
            ctx = Fanout(client, base, **kw)
            res = await ctx.run(agents)
            pool = await ctx.pool_tokens()
            prompts = [await ctx.agent_tokens(a) for a in agents]
            return res, {"pool": pool, "prompts": prompts}

    return asyncio.run(main())


def completion_agents() -> list[Agent]:
    params = {"n_predict": N_PREDICT, "temperature": 0.0}
    return [Agent(f"Question: {q}\nAnswer:", name=f"q{i}", params=params) for i, q in enumerate(QUESTIONS)]


def test_completion_fanout_shares_the_verified_prefix(server: LlamaServer) -> None:
    base = BasePrompt.from_text(base_text())
    kv = KVCellsLog(server.log_path)
    kv.mark()
    res, toks = fanout(server, base, completion_agents())
    time.sleep(0.3)
    peak = kv.read().peak
    pool = toks["pool"]
    for agent, prompt in zip(res.agents, toks["prompts"], strict=True):
        p = common_prefix_len(pool, prompt)
        assert p == len(pool) - 1, "the trailing blank line tokenizes differently inside the full prompt"
        assert agent.requested == p
        assert agent.status == "hit", agent.shared_prefix
        assert agent.shared == p
        assert agent.processed == agent.n_prompt - p
        assert agent.n_generated == N_PREDICT
    assert res.tokens_processed == len(pool) + sum(a.n_prompt - a.requested for a in res.agents)
    own = sum(a.n_prompt - a.requested + a.n_generated for a in res.agents)
    assert 0 < peak <= len(pool) + own + 8, (peak, len(pool), own)


def test_chat_fanout_hits(server: LlamaServer) -> None:
    base = BasePrompt.chat(system="Answer briefly.", document=base_text())
    agents = [Agent(q, params={"max_tokens": 8, "temperature": 0.0}) for q in QUESTIONS[:2]]
    res, toks = fanout(server, base, agents)
    for agent, prompt in zip(res.agents, toks["prompts"], strict=True):
        assert agent.mode == "chat"
        assert agent.status == "hit", agent.shared_prefix
        assert agent.requested == common_prefix_len(toks["pool"], prompt)
        assert agent.processed == agent.n_prompt - agent.requested
        assert agent.text


def test_reprime_when_the_pool_is_not_resident(server: LlamaServer) -> None:
    base = BasePrompt.from_text(base_text())
    agents = completion_agents()

    async def erase(client: AsyncClient, slots: range) -> None:
        for slot in slots:
            await client.erase_slot(slot)

    async def main() -> tuple[FanoutResult, FanoutResult]:
        async with AsyncClient(server.url, server=server) as client:
            ctx = Fanout(client, base)
            await ctx.prime()
            await erase(client, range(4))  # evict everything, the pool included
            missed = await ctx.run(agents)  # all at once, into empty slots
            await erase(client, range(1, 4))  # empty the agents' own caches, keep the pool
            again = await ctx.run(agents)
            return missed, again

    missed, again = asyncio.run(main())
    # agents that started before the re-prime finished miss (or find the pool busy); later ones hit
    assert {a.status for a in missed.agents} <= {"not_resident", "pool_busy", "hit"}, missed.statuses
    assert "not_resident" in missed.statuses
    assert [p.reason for p in missed.primes] == ["re-prime after not_resident"]
    for a in missed.agents:  # a miss is computed in full and still answered
        assert a.n_generated == N_PREDICT
        assert a.processed == (a.n_prompt - a.requested if a.status == "hit" else a.n_prompt)
    assert [a.status for a in again.agents] == ["hit"] * 3, again.statuses
    assert again.primes == []


def test_the_server_computes_p_and_agrees_with_the_client(server: LlamaServer) -> None:
    """pool_server reserves its pool, so a patched server that computes P says so in /props: the fan-out then
    sends shared_pool_slot alone, and the server's P is the one the client computes (server_prefix=False)."""
    base = BasePrompt.from_text(base_text())
    agents = completion_agents()[:2]

    async def main() -> tuple[FanoutResult, FanoutResult, bool]:
        async with AsyncClient(server.url, server=server) as client:
            runs = []
            for server_prefix in (None, False):
                for slot in range(1, 4):  # no agent slot's own cache in the way
                    await client.erase_slot(slot)
                runs.append(await Fanout(client, base, server_prefix=server_prefix).run(agents))
            return runs[0], runs[1], (await client.pool_features()).server_prefix

    auto, sent, offered = asyncio.run(main())
    assert offered, "this patched server does not announce polykv in /props"
    for a, s in zip(auto.agents, sent.agents, strict=True):
        assert a.status == s.status == "hit", (a.shared_prefix, s.shared_prefix)
        assert a.shared_prefix is not None and a.shared_prefix["auto"] == "prefix"
        assert a.shared_prefix["requested"] is None
        assert s.shared_prefix is not None and s.shared_prefix["requested"] == s.requested
        assert a.requested == a.shared == s.shared == s.requested

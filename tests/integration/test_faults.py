"""Faults during a fan-out, on the real patched llama-server and the default model.

- SIGKILL while agents generate: the fan-out raises ServerUnavailableError with the exit status and
  the server's log tail; LlamaServer.restart() brings the server back on the same port; the same
  Fanout primes the pool again and its agents hit; no llama-server process is left.
- SIGTERM while agents stream: llama-server exits with status 0. It only notices the shutdown in a
  streaming handler at the stream's next SSE ping (--sse-ping-interval, 30 s by default: upstream
  behaviour), so the server here runs with --sse-ping-interval 1 and exits within a few seconds.
- More agents than the KV cache holds: when a decode finds no free cells even after purging idle
  slots and halving the batch down to one token, llama-server fails *every* request being processed
  with HTTP 500 "Context size has been exceeded." (upstream behaviour; a request launched in the
  same iteration gets it too, even one that would have been refused on its own). A prompt longer
  than the context, alone, gets HTTP 400 "request (N tokens) exceeds the available context size".
  The server stays up and the pool still shares (a --pool-slots pool is never purged for room; an
  unreserved idle pool is the first slot purged, and one re-prime brings it back).

Kept cheap: 1 thread (2 stall under competing load), short prompts, few generated tokens (the long generations
are cut by the fault). Set POLYKV_RELIABILITY_OUT=path.json to get the outcomes as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from polykv_py.client import AsyncClient
from polykv_py.errors import ServerUnavailableError
from polykv_py.fanout import Agent, BasePrompt, Fanout
from polykv_py.presets import pool_server
from polykv_py.results import FanoutResult

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # fan-outs killed, stopped and overfilled, servers restarted

BASE = BasePrompt.from_text(
    "Team notes: the build runs nightly, the release ships on Fridays, and reviews are due within two days.\n"
)
LONG = {"n_predict": 400, "ignore_eos": True, "temperature": 0.0}  # still generating when the fault comes
SHORT = {"n_predict": 4, "temperature": 0.0}
QUESTIONS = ["Q: when does the release ship? A:", "Q: how often does the build run? A:", "Q: when are reviews due? A:"]

#: outcomes for the reliability report ($POLYKV_RELIABILITY_OUT)
OUTCOMES: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def summary() -> Iterator[None]:
    yield
    out = os.environ.get("POLYKV_RELIABILITY_OUT")
    if out and OUTCOMES:
        path = Path(out)
        doc = json.loads(path.read_text()) if path.is_file() else {}
        doc.update(OUTCOMES)
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def our_llama_servers() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "llama-server" in p.name() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def agents(params: dict[str, Any]) -> list[Agent]:
    return [Agent(q, name=f"a{i}", params=params) for i, q in enumerate(QUESTIONS)]


async def wait_generating(client: AsyncClient, run: asyncio.Future[Any], n: int, pool_slot: int = 0) -> None:
    """Until n agent slots are processing (the pool primed, the agents' requests running)."""
    deadline = time.monotonic() + 120
    while True:
        assert not run.done(), "the fan-out ended before the fault"
        slots = await client.slots()
        if sum(s["is_processing"] and s["id"] != pool_slot for s in slots) >= n:
            return
        assert time.monotonic() < deadline, slots
        await asyncio.sleep(0.05)


# ----------------------------------------------------------------------------- SIGKILL


def test_sigkill_mid_fanout_then_restart_and_reprime(patched_server_bin: Path, model_path: Path) -> None:
    srv = pool_server(n_agents_parallel=3, ctx=1024, threads=1, track_kv=False, name="fault-kill")
    srv.start()
    first_pid, port = srv.pid, srv.port
    try:

        async def scenario() -> tuple[ServerUnavailableError, FanoutResult, float]:
            async with srv.async_client() as client:
                ctx = Fanout(client, BASE)
                run = asyncio.ensure_future(ctx.run(agents(LONG)))
                await wait_generating(client, run, len(QUESTIONS))
                os.kill(first_pid, signal.SIGKILL)
                with pytest.raises(ServerUnavailableError) as info:
                    await run
                t0 = time.monotonic()
                srv.restart()  # from the main thread: the new process dies with this one, too
                restart_s = time.monotonic() - t0
                again = await ctx.run(agents(SHORT))  # same context, same client, same URL
                return info.value, again, restart_s

        err, again, restart_s = asyncio.run(scenario())
        # a clear error: what happened, the exit status, and the server's own last words
        msg = str(err)
        assert err.exit_status == -signal.SIGKILL, msg
        assert "server process exited" in msg and f"(exit status {-signal.SIGKILL})" in msg
        assert "--- server log tail ---" in msg and "polykv: shared" in err.log_tail, err.log_tail
        assert gone(first_pid)
        # the server came back where the client expects it, and the fan-out re-primed before its agents
        assert srv.port == port and srv.pid != first_pid and srv.health_state() == "ok"
        assert [p.reason for p in again.primes] == ["re-prime after server gone"]
        assert [a.status for a in again.agents] == ["hit"] * len(QUESTIONS), again.statuses
        assert all(a.ok and a.n_generated == SHORT["n_predict"] for a in again.agents)
        second_pid = srv.pid
        OUTCOMES.update(
            {
                "fault_sigkill_error_type": type(err).__name__,
                "fault_sigkill_error_first_line": msg.splitlines()[0],
                "fault_sigkill_exit_status": err.exit_status,
                "fault_sigkill_restart_s": round(restart_s, 2),
                "fault_sigkill_same_port": srv.port == port,
                "fault_sigkill_reprime_reason": again.primes[0].reason,
                "fault_sigkill_statuses_after_restart": again.statuses,
            }
        )
    finally:
        srv.stop()
    assert gone(second_pid)
    assert our_llama_servers() == []
    OUTCOMES["fault_sigkill_orphans"] = len(our_llama_servers())


# ----------------------------------------------------------------------------- SIGTERM


def test_sigterm_mid_fanout_exits_cleanly(patched_server_bin: Path, model_path: Path) -> None:
    srv = pool_server(
        n_agents_parallel=3,
        ctx=1024,
        threads=1,
        track_kv=False,
        name="fault-term",
        extra_args=["--sse-ping-interval", "1"],
    )
    srv.start()
    pid = srv.pid
    try:

        async def scenario() -> tuple[ServerUnavailableError, int | None, float]:
            async with srv.async_client() as client:
                run = asyncio.ensure_future(Fanout(client, BASE).run(agents(LONG)))
                await wait_generating(client, run, len(QUESTIONS))
                t0 = time.monotonic()
                status = await asyncio.to_thread(srv.stop, 20)  # SIGTERM, SIGKILL only after 20 s
                took = time.monotonic() - t0
                with pytest.raises(ServerUnavailableError) as info:
                    await run
                return info.value, status, took

        err, status, took = asyncio.run(scenario())
    finally:
        srv.stop()
    assert status == 0, srv.log_tail()
    assert took < 10, took
    assert gone(pid) and our_llama_servers() == []
    assert err.exit_status == 0 and "server process exited" in str(err)
    assert "cleaning up before exit" in err.log_tail
    OUTCOMES.update(
        {
            "fault_sigterm_exit_status": status,
            "fault_sigterm_exit_s": round(took, 2),
            "fault_sigterm_sse_ping_interval_s": 1,
            "fault_sigterm_client_error": str(err).splitlines()[0],
        }
    )


# ----------------------------------------------------------------------------- over capacity

CTX = 512
#: each agent fits alone (base + ~300 + 2 < 512 cells); any two at once do not
PRIVATE = " ".join(f"w{k}" for k in range(90))
OVERSIZED = " ".join(f"x{k}" for k in range(200))  # alone longer than the whole context


def test_more_agents_than_the_context_holds(patched_server_bin: Path, model_path: Path) -> None:
    srv = pool_server(n_agents_parallel=4, ctx=CTX, threads=1, track_kv=False, name="fault-capacity")
    params = {"n_predict": 2, "temperature": 0.0}
    crowd = [Agent(f"Agent {i} notes: {PRIVATE}\nQ: summary? A:", name=f"crowd{i}", params=params) for i in range(3)]
    huge = Agent(f"Notes: {OVERSIZED}\nA:", name="oversized", params=params)
    probe = [Agent("Q: when is the release? A:", name="probe", params=params)]
    with srv:

        async def scenario() -> tuple[FanoutResult, list[int], FanoutResult, FanoutResult | None]:
            async with srv.async_client() as client:
                ctx = Fanout(client, BASE)
                n_prompt = [len(await ctx.agent_tokens(a)) for a in [*crowd, huge]]
                res = await ctx.run(crowd)
                alone = await ctx.run([huge])
                for slot in range(1, 5):  # the agent slots forget the base: only the pool can serve it now
                    await client.erase_slot(slot)
                after = await ctx.run(probe)  # the pool, after the KV cache was full
                again = None if after.agents[0].status == "hit" else await ctx.run(probe)
                return res, n_prompt, alone, after, again

        res, n_prompt, alone, after, again = asyncio.run(scenario())
        n_pool = res.pool_tokens
        assert all(n < CTX for n in n_prompt[:3]) and n_pool + n_prompt[0] - res.agents[0].requested + 2 < CTX
        assert n_pool + 2 * (n_prompt[0] - res.agents[0].requested) > CTX
        assert n_prompt[3] > CTX
        # a prompt longer than the context, sent alone, is refused at once with its own 400
        # (sent with the crowd it may instead share the crowd's 500: a failed decode fails every slot being processed)
        big = alone.agents[0]
        assert big.status == "error" and big.error and big.error.startswith("HTTP 400 "), big.error
        assert f"request ({n_prompt[3]} tokens) exceeds the available context size ({CTX} tokens)" in big.error
        # the crowd: every request either answered (a hit) or failed with the server's context error
        failed = [a for a in res.agents if not a.ok]
        for a in res.agents:
            if a.ok:
                assert a.status == "hit" and a.n_generated == 2, a
            else:
                assert a.error and a.error.startswith("HTTP 500 ") and "Context size has been exceeded" in a.error
        assert failed, "all three agents fit: the test no longer overflows the KV cache"
        # the server survived, and so did the pool (or, if llama-server purged it for room, one re-prime fixes it)
        assert srv.is_alive() and srv.health_state() == "ok"
        log = srv.log_path.read_text(errors="replace")
        assert "Context size has been exceeded" in log
        purged = "purging slot 0 " in log
        pinned = "--pool-slots" in srv.args
        if pinned or not purged:
            assert after.agents[0].status == "hit", (after.statuses, purged)
        else:  # an unreserved idle pool is the first slot llama-server purges when the cache is full
            assert after.agents[0].status == "not_resident" and after.primes[0].reason.startswith("re-prime")
            assert again is not None and again.agents[0].status == "hit"
        assert not (pinned and purged), "a --pool-slots pool was purged"
    OUTCOMES.update(
        {
            "fault_overcap_ctx": CTX,
            "fault_overcap_agents": len(res.agents),
            "fault_overcap_pool_tokens": n_pool,
            "fault_overcap_prompt_tokens": n_prompt[:3],
            "fault_overcap_errors": sorted({a.error.split(": ", 1)[1] for a in res.agents if a.error}),
            "fault_overcap_statuses": res.statuses,
            "fault_overcap_oversized_prompt_tokens": n_prompt[3],
            "fault_overcap_oversized_error": big.error.split(": ", 1)[1],
            "fault_overcap_failed_crowd": len(failed),
            "fault_overcap_pool_slots_flag": pinned,
            "fault_overcap_pool_purged": purged,
            "fault_overcap_probe_status_after": after.agents[0].status,
            "fault_overcap_server_alive": True,
        }
    )

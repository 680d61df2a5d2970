"""Fanout against a fake llama-server (httpx.MockTransport): priming, P, statuses, re-priming."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from polykv_py.client import AsyncClient
from polykv_py.fanout import Agent, BasePrompt, Fanout, FanoutError
from polykv_py.tokens import common_prefix_len

TRAP = 9999  # a trailing "\n\n" alone is one token; followed by text it is two "\n" tokens


def tokenize(text: str) -> list[int]:
    if text.endswith("\n\n"):
        return [ord(c) for c in text[:-2]] + [TRAP]
    return [ord(c) for c in text]


def sse(events: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


@dataclass
class FakeServer:
    """Just enough of the patched llama-server for Fanout."""

    slots: int = 4
    pool: dict[int, list[int]] = field(default_factory=dict)
    evict_after: int | None = None  # drop the pool after this many agent requests
    patched: bool = True
    primes: list[dict] = field(default_factory=list)
    agent_bodies: list[dict] = field(default_factory=list)
    fail_prompt: str | None = None
    stale: int = 0  # drop this many agent requests as a closed kept-alive connection would
    server_prefix: bool = False  # a newer patch: /props has "polykv", P computed when not sent
    pool_slots: tuple[int, ...] = ()  # reserved pools (a share must name one: else HTTP 400)

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        path = request.url.path
        if path == "/props":
            props: dict[str, Any] = {"total_slots": self.slots}
            if self.server_prefix:
                props["polykv"] = {"pool_slots": list(self.pool_slots), "pool_auto": False, "pool_auto_min_tokens": 64}
            return httpx.Response(200, json=props)
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": tokenize(body["content"])})
        if path == "/apply-template":
            text = "".join(f"<{m['role']}>{m['content']}</>" for m in body["messages"])
            if body.get("add_generation_prompt", True):
                text += "<assistant>"
            return httpx.Response(200, json={"prompt": text})
        if path == "/completion" and not body.get("stream"):
            self.primes.append(body)
            self.pool[body["id_slot"]] = list(body["prompt"])
            return httpx.Response(200, json={"content": "", "timings": {"prompt_n": len(body["prompt"])}})
        if path in ("/completion", "/v1/chat/completions"):
            return self._agent(path, body)
        return httpx.Response(404, json={"error": {"message": f"no {path}"}})

    def _agent(self, path: str, body: dict) -> httpx.Response:
        if self.stale:
            self.stale -= 1
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        self.agent_bodies.append(body)
        chat = path != "/completion"
        if chat:
            text = "".join(f"<{m['role']}>{m['content']}</>" for m in body["messages"]) + "<assistant>"
        else:
            text = body["prompt"]
        if self.fail_prompt and self.fail_prompt in text:
            return httpx.Response(500, json={"error": {"message": "boom", "code": 500}})
        tokens = tokenize(text)
        p = body.get("shared_prefix_n_tokens", 0)
        sp: dict[str, Any] | None = None
        cached = 0
        if self.pool_slots and body.get("shared_pool_slot", self.pool_slots[0]) not in self.pool_slots:
            return httpx.Response(400, json={"error": {"message": "not a reserved pool slot", "code": 400}})
        if self.evict_after is not None and len(self.agent_bodies) > self.evict_after:
            self.pool.clear()
            self.evict_after = None
        auto = self.server_prefix and "shared_pool_slot" in body and "shared_prefix_n_tokens" not in body
        if auto:
            pool = self.pool.get(body["shared_pool_slot"]) or []
            p = min(common_prefix_len(pool, tokens), len(tokens) - 1)
            if p == 0:
                sp = {"pool_slot": 0, "requested": None, "shared": 0, "status": "no_prefix", "auto": "prefix"}
        if "shared_pool_slot" in body and self.patched and sp is None:
            pool = self.pool.get(body["shared_pool_slot"])
            if pool is None:
                sp = {"pool_slot": 0, "requested": p, "shared": 0, "status": "not_resident"}
            elif pool[:p] != tokens[:p]:
                sp = {"pool_slot": 0, "requested": p, "shared": 0, "status": "mismatch"}
            else:
                sp = {"pool_slot": 0, "requested": p, "shared": p, "status": "hit"}
                cached = p
            if auto:
                sp = {**sp, "requested": None, "auto": "prefix"}
        timings = {"prompt_n": len(tokens) - cached, "cache_n": cached, "predicted_n": 2}
        if chat:
            events: list[dict] = [
                {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
                {"choices": [{"index": 0, "delta": {"content": "ok"}}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "timings": timings},
            ]
        else:
            events = [
                {"content": "ok", "tokens": [1], "stop": False},
                {"content": "", "tokens": [], "stop": True, "stop_type": "limit", "id_slot": 1, "timings": timings},
            ]
        if sp is not None:
            events[-1]["shared_prefix"] = sp
        return httpx.Response(200, content=sse(events), headers={"content-type": "text/event-stream"})


def run(server: FakeServer, base: BasePrompt, agents: list[Agent], **kw: Any):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        client = AsyncClient("http://fake", transport=httpx.MockTransport(server.handler))
        async with client:
            ctx = Fanout(client, base, **kw)
            res = await ctx.run(agents)
            return ctx, res

    return asyncio.run(main())


def test_completion_fanout_primes_pinned_and_sends_the_verified_p() -> None:
    server = FakeServer()
    base = BasePrompt.from_text("shared document\n\n")
    agents = [Agent(f"question {i}") for i in range(5)]
    _ctx, res = run(server, base, agents)
    assert len(server.primes) == 1
    prime = server.primes[0]
    assert prime["id_slot"] == 0 and prime["prompt"] == tokenize(base.text or "")
    n_base = len("shared document")  # the "\n\n" token is not part of the agents' prompts
    assert all(b["shared_prefix_n_tokens"] == n_base and b["shared_pool_slot"] == 0 for b in server.agent_bodies)
    assert [a.status for a in res.agents] == ["hit"] * 5
    for a in res.agents:
        assert a.processed == a.n_prompt - a.requested
        assert a.text == "ok" and a.ttft_s is not None
    assert res.tokens_processed == len(prime["prompt"]) + sum(a.processed for a in res.agents)
    assert res.pool_tokens == len(prime["prompt"])
    assert [a.index for a in res.agents] == list(range(5))


def test_chat_fanout_uses_the_templated_prompts() -> None:
    server = FakeServer()
    base = BasePrompt.chat(system="S", document="D")
    _ctx, res = run(server, base, [Agent("q1"), Agent("q2")])
    pool_text = "<system>S\n\nD</>"
    assert server.primes[0]["prompt"] == tokenize(pool_text)
    assert all(b["shared_prefix_n_tokens"] == len(pool_text) for b in server.agent_bodies)
    assert all(a.status == "hit" and a.mode == "chat" for a in res.agents)


def test_not_resident_reprimes_once_and_goes_on() -> None:
    server = FakeServer(evict_after=2)
    base = BasePrompt.from_text("document ")
    _ctx, res = run(server, base, [Agent(f"q{i}") for i in range(6)], concurrency=1)
    statuses = [a.status for a in res.agents]
    assert statuses.count("not_resident") == 1
    assert statuses[:2] == ["hit", "hit"] and statuses[3:] == ["hit"] * 3
    assert len(server.primes) == 2 and [p.reason for p in res.primes][1].startswith("re-prime")
    # the agent that saw the miss still got an answer, computed in full
    miss = res.agents[statuses.index("not_resident")]
    assert miss.text == "ok" and miss.processed == miss.n_prompt


def test_share_false_sends_no_sharing_fields_and_no_prime() -> None:
    server = FakeServer()
    _ctx, res = run(server, BasePrompt.from_text("doc "), [Agent("a"), Agent("b")], share=False)
    assert server.primes == []
    assert all("shared_pool_slot" not in b for b in server.agent_bodies)
    assert all(a.status == "not_shared" for a in res.agents)


def test_unpatched_server_is_reported() -> None:
    server = FakeServer(patched=False)
    with pytest.raises(FanoutError, match="patched"):
        run(server, BasePrompt.from_text("doc "), [Agent("a")])


def test_a_failing_agent_becomes_an_error_result() -> None:
    server = FakeServer(fail_prompt="bad")
    _ctx, res = run(server, BasePrompt.from_text("doc "), [Agent("good"), Agent("bad one")])
    assert res.agents[0].status == "hit"
    assert res.agents[1].status == "error" and "boom" in (res.agents[1].error or "")


def test_extra_body_for_the_openai_client() -> None:
    server = FakeServer()

    async def main() -> dict:
        async with AsyncClient("http://fake", transport=httpx.MockTransport(server.handler)) as client:
            ctx = Fanout(client, BasePrompt.from_text("doc\n\n"), pool_slot=2)
            return await ctx.extra_body(Agent("q"))

    assert asyncio.run(main()) == {"shared_pool_slot": 2, "shared_prefix_n_tokens": 3}


def test_a_stale_connection_is_retried_once() -> None:
    server = FakeServer(stale=1)
    _ctx, res = run(server, BasePrompt.from_text("doc "), [Agent("a")])
    assert res.agents[0].status == "hit" and len(server.agent_bodies) == 1
    server = FakeServer(stale=2)
    _ctx, res = run(server, BasePrompt.from_text("doc "), [Agent("a")])
    assert res.agents[0].status == "error" and "disconnected" in (res.agents[0].error or "")


def test_a_server_that_is_gone_fails_the_run_and_the_next_run_primes_again() -> None:
    """keep_going covers a failing request, not a dead server: refused connections end the run with
    ServerUnavailableError, the agents still queued are cancelled, and after a restart (here: the fake
    comes back with an empty KV cache) the same Fanout primes before its agents and they hit."""
    from polykv_py.errors import ServerUnavailableError

    server = FakeServer()
    state = {"down": False}
    sent_while_down: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if state["down"]:
            sent_while_down.append(request.url.path)
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return server.handler(request)

    async def main() -> tuple[Any, Any, BaseException | None]:
        async with AsyncClient("http://fake", transport=httpx.MockTransport(handler)) as client:
            ctx = Fanout(client, BasePrompt.from_text("doc "), concurrency=1)
            agents = [Agent(f"q{i}") for i in range(4)]
            first = await ctx.run(agents)
            state["down"] = True
            failure: BaseException | None = None
            try:
                await ctx.run(agents)  # tokens known: the first request to fail is an agent's
            except ServerUnavailableError as exc:
                failure = exc
            state["down"] = False
            server.pool.clear()  # a restarted server holds no KV
            again = await ctx.run(agents)
            return first, again, failure

    first, again, failure = asyncio.run(main())
    assert [a.status for a in first.agents] == ["hit"] * 4
    assert failure is not None and "Connection refused" in str(failure)
    # concurrency 1: the first agent failed (sent twice: a refused connection may be a stale one), the rest
    # never went out
    assert sent_while_down == ["/completion", "/completion"]
    assert [p.reason for p in again.primes] == ["re-prime after server gone"]
    assert [a.status for a in again.agents] == ["hit"] * 4


def test_a_server_that_computes_p_gets_the_pool_slot_alone() -> None:
    server = FakeServer(server_prefix=True, pool_slots=(0,))
    base = BasePrompt.from_text("shared document\n\n")
    _ctx, res = run(server, base, [Agent(f"question {i}") for i in range(3)])
    assert all(b == {**b, "shared_pool_slot": 0} and "shared_prefix_n_tokens" not in b for b in server.agent_bodies)
    n_base = len("shared document")  # the server's P: the "\n\n" token is not in the agents' prompts
    for a in res.agents:
        assert a.status == "hit" and a.shared_prefix and a.shared_prefix["auto"] == "prefix"
        assert a.requested == a.shared == n_base  # the server's count
        assert a.processed == a.n_prompt - n_base
    assert res.prefix_tokens == n_base


def test_server_prefix_false_sends_p_to_any_server() -> None:
    server = FakeServer(server_prefix=True)
    _ctx, res = run(server, BasePrompt.from_text("doc "), [Agent("a")], server_prefix=False)
    assert server.agent_bodies[0]["shared_prefix_n_tokens"] == 4
    assert res.agents[0].status == "hit" and res.agents[0].requested == 4


def test_a_pool_slot_the_server_does_not_reserve_is_refused_before_priming() -> None:
    server = FakeServer(server_prefix=True, pool_slots=(0, 1))
    with pytest.raises(FanoutError, match="slot 2 is not a reserved pool slot"):
        run(server, BasePrompt.from_text("doc "), [Agent("a")], pool_slot=2)
    assert server.primes == [] and server.agent_bodies == []


def test_with_the_servers_p_no_prefix_means_the_pool_is_gone() -> None:
    server = FakeServer(server_prefix=True, evict_after=1)
    _ctx, res = run(server, BasePrompt.from_text("document "), [Agent(f"q{i}") for i in range(3)], concurrency=1)
    assert [a.status for a in res.agents] == ["hit", "no_prefix", "hit"]
    assert [p.reason for p in res.primes] == ["initial", "re-prime after no_prefix"]
    assert res.agents[1].requested == 0 and res.agents[1].processed == res.agents[1].n_prompt


def test_extra_body_leaves_p_to_a_server_that_computes_it() -> None:
    server = FakeServer(server_prefix=True)

    async def main() -> dict:
        async with AsyncClient("http://fake", transport=httpx.MockTransport(server.handler)) as client:
            ctx = Fanout(client, BasePrompt.from_text("doc\n\n"), pool_slot=2)
            return await ctx.extra_body(Agent("q"))

    assert asyncio.run(main()) == {"shared_pool_slot": 2}

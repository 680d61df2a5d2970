"""Routing keys, replica-failure classification and the gateway's command line (no servers)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_py.client import ROUTED_WORKER_HEADER, AsyncClient, chunk_finishes
from polykv_py.errors import HTTPError, ServerUnavailableError
from polykv_py.fanout import Agent, BasePrompt, token_probs
from polykv_py.gateway import (
    MAX_ROUTING_KEY_BYTES,
    ROUTING_KEY_HEADER,
    GatewayOptions,
    worker_list,
)
from polykv_py.pools import PoolCache, pool_file_name, tokens_mac
from polykv_py.prefix_file import tokens_sha256
from polykv_py.routing import ReplicaError, Router, failed_replica, is_replica_failure, routing_key

GATEWAY_CONNECT_ERROR = (
    "error sending request for url (http://127.0.0.1:49083/v1/completions). URL: http://127.0.0.1:49083/v1/completions"
)
GATEWAY_STREAM_ERROR = (
    "Stream error: error decoding response body: request or response body error: error reading a body from "
    "connection: unexpected EOF during chunk size line"
)


def test_routing_key_names_the_pool_and_nothing_else() -> None:
    a = BasePrompt.from_text("the base")
    key = routing_key("polykv", a)
    assert key == routing_key("polykv", BasePrompt.from_text("the base"))  # stable across processes
    assert key.startswith("pool-") and len(key.encode()) <= MAX_ROUTING_KEY_BYTES
    others = {
        routing_key("polykv", BasePrompt.from_text("the base ")),
        routing_key("other-model", a),
        routing_key("polykv", a, cache_salt="team-a"),
        routing_key("polykv", BasePrompt.chat(document="the base")),
    }
    assert key not in others and len(others) == 4
    assert routing_key("polykv", a, "team-a") != routing_key("polykv", a, "team-b")


@pytest.mark.parametrize(
    ("exc", "replica_failed"),
    [
        (HTTPError(500, GATEWAY_CONNECT_ERROR), True),
        (HTTPError(500, GATEWAY_STREAM_ERROR), True),
        (HTTPError(503, "No available workers"), True),
        (HTTPError(500, "Context size has been exceeded."), False),  # the replica's own answer
        (HTTPError(400, "Field 'shared_pool_slot': slot 5 is not a pool slot"), False),
        (ServerUnavailableError("the answer stream from http://gw/v1/completions ended early"), True),
        (ServerUnavailableError("request failed", exit_status=-9), False),  # the gateway itself is gone
    ],
)
def test_replica_failures_are_told_from_request_errors(exc: Exception, replica_failed: bool) -> None:
    assert is_replica_failure(exc) is replica_failed


def test_the_failed_replica_is_named() -> None:
    assert failed_replica(Exception(GATEWAY_CONNECT_ERROR)) == "http://127.0.0.1:49083"
    assert failed_replica(Exception("x"), {"x-smg-routed-worker-id": "http://h:1"}) == "http://h:1"
    assert failed_replica(Exception("no url here")) is None
    assert ReplicaError("m", replica="http://h:1").replica == "http://h:1"


def test_gateway_options_become_smg_flags() -> None:
    manual = GatewayOptions().args()
    assert manual[:4] == ["--policy", "manual", "--assignment-mode", "min_group"]
    assert "--disable-retries" in manual
    rr = GatewayOptions(policy="round_robin", retries=3).args()
    assert "--assignment-mode" not in rr and rr[rr.index("--retry-max-retries") + 1] == "3"
    assert worker_list({"workers": [{"url": "u"}, 3]}) == [{"url": "u"}]
    assert worker_list([{"url": "v"}]) == [{"url": "v"}]


def test_a_stream_cut_short_is_an_error_not_a_short_answer() -> None:
    assert chunk_finishes({"content": "", "stop": True})
    assert chunk_finishes({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    assert not chunk_finishes({"choices": [{"index": 0, "text": "x", "finish_reason": None}]})

    def body(lines: list[str]) -> httpx.MockTransport:
        return httpx.MockTransport(lambda req: httpx.Response(200, text="".join(f"data: {x}\n\n" for x in lines)))

    async def read(lines: list[str]) -> list[dict[str, object]]:
        async with AsyncClient("http://replica", transport=body(lines)) as c:
            return [x async for x in c.stream_events("/v1/completions", {"prompt": "p"})]

    part = '{"choices":[{"index":0,"text":"a","finish_reason":null}]}'
    done = '{"choices":[{"index":0,"text":"","finish_reason":"length"}]}'
    assert len(asyncio.run(read([part, done, "[DONE]"]))) == 2
    with pytest.raises(ServerUnavailableError, match="ended before the answer was complete"):
        asyncio.run(read([part, part]))


def test_token_probs_read_both_answer_shapes() -> None:
    entry = {"id": 5, "token": "x", "logprob": -0.1, "top_logprobs": []}
    assert token_probs({"completion_probabilities": [entry]}) == [entry]
    assert token_probs({"choices": [{"logprobs": {"content": [entry]}}]}) == [entry]
    assert token_probs({"choices": [{"text": "x"}]}) is None


# ------------------------------------------------------------------------------ RoutedFanout against a fake cluster
REPLICA = "http://replica-1:8080"
IDENTITY = {"format": 3, "model": {"sha256": "ab" * 32}, "kv": {"n_stream": 1}}


@dataclass
class FakeCluster:
    """A gateway (http://gw) and one replica behind it, enough for a RoutedFanout; records every request."""

    pool_files: bool = False
    salted_resident: str | None = None  # the salt of a pool the replica already holds (slot 0), if any
    requests: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # (host, path?query, body)
    pool: list[int] = field(default_factory=list)

    def tokens(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        path = request.url.path
        self.requests.append((request.url.host, request.url.raw_path.decode(), body))
        if request.url.host == "gw":
            assert request.headers.get(ROUTING_KEY_HEADER, "").startswith("pool-")
            routed = {ROUTED_WORKER_HEADER: REPLICA}
            if not body.get("stream"):  # Router.locate
                return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]}, headers=routed)
            sp = {"pool_slot": 0, "requested": None, "shared": len(self.pool), "status": "hit", "auto": "prefix"}
            final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "shared_prefix": sp}
            events = [{"choices": [{"index": 0, "text": "ok", "finish_reason": None}]}, final]
            data = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
            return httpx.Response(200, content=data, headers={"content-type": "text/event-stream", **routed})
        if path == "/props":
            polykv: dict[str, Any] = {"pool_slots": [0, 1], "pool_auto": False, "pool_auto_min_tokens": 64}
            if self.pool_files:
                polykv["pool_files"] = IDENTITY
            return httpx.Response(200, json={"total_slots": 4, "polykv": polykv})
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": self.tokens(body["content"])})
        if path == "/slots" and request.method == "GET":
            return httpx.Response(200, json=[self.slot_state(0), self.slot_state(1), {"id": 2}, {"id": 3}])
        if path == "/completion":
            self.pool = list(body["prompt"])
            return httpx.Response(200, json={"content": "", "timings": {"prompt_n": len(self.pool)}})
        if path.startswith("/slots/") and request.url.params.get("action") == "restore":
            return httpx.Response(400, json={"error": {"message": "no such file", "code": 400}})
        if path.startswith("/slots/") and request.url.params.get("action") == "save":
            return httpx.Response(200, json={"n_saved": len(self.pool)})
        return httpx.Response(404, json={"error": {"message": f"no {path}", "code": 404}})

    def slot_state(self, slot: int) -> dict[str, Any]:
        """/slots as the server reports pool ``slot``: slot 0 may hold a salted pool, the rest are empty."""
        st: dict[str, Any] = {"resident": False, "salted": False, "n_tokens": 0, "tokens_sha256": None,
                              "tokens_mac": None, "hits": 0, "sharers": 0, "last_use_s_ago": None,
                              "restored_from": None}  # fmt: skip
        if slot == 0 and self.salted_resident is not None:
            toks = self.tokens(BASE_TEXT)
            mac = tokens_mac(toks, self.salted_resident)
            st |= {"resident": True, "salted": True, "n_tokens": None, "tokens_mac": mac}
        return {"id": slot, "polykv_pool": True, "polykv_pool_state": st}

    def replica_posts(self, path: str) -> list[dict[str, Any]]:
        return [b for host, p, b in self.requests if host == "replica-1" and p.startswith(path)]

    def agent_bodies(self) -> list[dict[str, Any]]:
        return [b for host, _, b in self.requests if host == "gw" and b.get("stream")]


BASE_TEXT = "a shared document\n"


class FakeRouter(Router):
    def __init__(self, cluster: FakeCluster) -> None:
        super().__init__("http://gw")
        self.transport = httpx.MockTransport(cluster.handler)
        self.client = AsyncClient("http://gw", transport=self.transport)

    def replica(self, url: str) -> AsyncClient:
        if url not in self._replicas:
            self._replicas[url] = AsyncClient(url, transport=self.transport)
        return self._replicas[url]


def routed_run(cluster: FakeCluster, **kwargs: Any) -> Any:
    async def main() -> Any:
        async with FakeRouter(cluster) as router:
            ctx = router.context(BasePrompt.from_text(BASE_TEXT), **kwargs)
            res = await ctx.run([Agent("question one", "one"), Agent("question two", "two", params={"n_predict": 3})])
            await ctx.aclose()
            return ctx, res

    return asyncio.run(main())


def test_a_salted_routed_context_sends_its_salt_on_the_prime_and_every_agent() -> None:
    """Issue 26 item 5: RoutedFanout(cache_salt=...) used the salt only for its routing key."""
    cluster = FakeCluster()
    ctx, res = routed_run(cluster, cache_salt="team-a")
    assert [a.status for a in res.agents] == ["hit", "hit"]
    primes = cluster.replica_posts("/completion")
    assert len(primes) == 1 and primes[0]["id_slot"] == 0 and primes[0]["cache_salt"] == "team-a"
    agents = cluster.agent_bodies()
    assert len(agents) == 2 and all(b["cache_salt"] == "team-a" and b["shared_pool_slot"] == 0 for b in agents)
    assert ctx.key == routing_key("polykv", BasePrompt.from_text(BASE_TEXT), "team-a")


def test_an_unsalted_routed_context_sends_no_salt() -> None:
    cluster = FakeCluster()
    routed_run(cluster)
    assert "cache_salt" not in cluster.replica_posts("/completion")[0]
    assert all("cache_salt" not in b for b in cluster.agent_bodies())


def test_a_salted_routed_context_restores_and_saves_its_pool_file_with_the_salt(tmp_path: Path) -> None:
    cluster = FakeCluster(pool_files=True)
    ctx, _ = routed_run(cluster, cache_salt="team-a", pool_cache=PoolCache(tmp_path))
    toks = cluster.tokens(BASE_TEXT)
    name = pool_file_name(IDENTITY, toks, "team-a")
    assert name != pool_file_name(IDENTITY, toks), "the salt is part of the pool file's name"
    restore, save = cluster.replica_posts("/slots/0?action=restore"), cluster.replica_posts("/slots/0?action=save")
    assert restore == [{"filename": name, "tokens": toks, "cache_salt": "team-a"}]
    assert save == [{"filename": name, "cache_salt": "team-a"}]
    assert ctx.primes[0].saved_to == name


def test_claim_finds_a_salted_pool_only_with_its_salt() -> None:
    """A replica's slot 0 holds the base under "team-a": a context with that salt takes it as resident
    (no prime); one with another salt, or none, primes its own pool in another slot."""
    toks = [ord(c) for c in BASE_TEXT]
    assert tokens_sha256(toks) != tokens_mac(toks, "team-a")
    for salt, slot, primed in (("team-a", 0, False), ("team-b", 1, True), (None, 1, True)):
        cluster = FakeCluster(salted_resident="team-a")
        ctx, _ = routed_run(cluster, cache_salt=salt)
        assert ctx.moves[0].pool_slot == slot, salt
        assert bool(cluster.replica_posts("/completion")) is primed, salt
        assert all(b["shared_pool_slot"] == slot for b in cluster.agent_bodies())

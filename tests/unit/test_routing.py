"""Routing keys, replica-failure classification and the gateway's command line (no servers)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from polykv_py.client import AsyncClient, chunk_finishes
from polykv_py.errors import HTTPError, ServerUnavailableError
from polykv_py.fanout import BaseContext, token_probs
from polykv_py.gateway import MAX_ROUTING_KEY_BYTES, GatewayOptions, worker_list
from polykv_py.routing import ReplicaError, failed_replica, is_replica_failure, routing_key

GATEWAY_CONNECT_ERROR = (
    "error sending request for url (http://127.0.0.1:49083/v1/completions). URL: http://127.0.0.1:49083/v1/completions"
)
GATEWAY_STREAM_ERROR = (
    "Stream error: error decoding response body: request or response body error: error reading a body from "
    "connection: unexpected EOF during chunk size line"
)


def test_routing_key_names_the_pool_and_nothing_else() -> None:
    a = BaseContext.from_text("the base")
    key = routing_key("polykv", a)
    assert key == routing_key("polykv", BaseContext.from_text("the base"))  # stable across processes
    assert key.startswith("pool-") and len(key.encode()) <= MAX_ROUTING_KEY_BYTES
    others = {
        routing_key("polykv", BaseContext.from_text("the base ")),
        routing_key("other-model", a),
        routing_key("polykv", a, cache_salt="team-a"),
        routing_key("polykv", BaseContext.chat(document="the base")),
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

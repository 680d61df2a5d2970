"""Client error mapping and request bodies, with httpx.MockTransport (no server)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from polykv_py.client import AsyncClient, Client
from polykv_py.errors import HTTPError, ServerUnavailableError


class FakeServer:
    """Stands in for a LlamaServer: a log tail and an exit status."""

    returncode = -9

    def log_tail(self, n: int = 40) -> str:
        return "srv  load_model: boom"


def error_response(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": status, "message": message, "type": "x"}})


def test_http_error_carries_server_message() -> None:
    client = Client("http://srv", transport=httpx.MockTransport(lambda r: error_response(400, "prompt too long")))
    with pytest.raises(HTTPError) as info:
        client.completion("hi", n_predict=4)
    assert info.value.status == 400
    assert info.value.server_message == "prompt too long"
    assert info.value.url == "http://srv/completion"


def test_stream_error_before_first_chunk_is_http_error() -> None:
    client = Client("http://srv", transport=httpx.MockTransport(lambda r: error_response(503, "Loading model")))
    with pytest.raises(HTTPError) as info:
        client.chat_stream([{"role": "user", "content": "x"}])
    assert info.value.status == 503 and "Loading model" in str(info.value)


def test_stream_error_event_mid_stream() -> None:
    body = 'data: {"content": "a"}\n\ndata: {"error": {"code": 500, "message": "decode failed"}}\n\n'
    client = Client("http://srv", transport=httpx.MockTransport(lambda r: httpx.Response(200, text=body)))
    with pytest.raises(HTTPError, match="decode failed"):
        client.completion_stream("x")


def test_connection_failure_is_unavailable_with_log_tail() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = Client("http://srv", transport=httpx.MockTransport(refuse), server=FakeServer())
    with pytest.raises(ServerUnavailableError) as info:
        client.health()
    assert info.value.exit_status == -9
    assert "load_model: boom" in info.value.log_tail
    assert "connection refused" in str(info.value)


def test_request_bodies_carry_pool_fields_and_extra() -> None:
    seen: list[dict[str, object]] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"content": "", "tokens": []})

    client = Client("http://srv", api_key="k", transport=httpx.MockTransport(record))
    client.completion("p", n_predict=8, shared_pool_slot=0, shared_prefix_n_tokens=12, extra={"id_slot": 2})
    client.completion("p", extra={"shared_pool_slot": 1})
    assert seen[0] == {"prompt": "p", "n_predict": 8, "shared_pool_slot": 0, "shared_prefix_n_tokens": 12, "id_slot": 2}
    assert seen[1] == {"prompt": "p", "shared_pool_slot": 1}


def test_api_key_header() -> None:
    headers: list[str | None] = []

    def record(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"status": "ok"})

    Client("http://srv", api_key="secret", transport=httpx.MockTransport(record)).health()
    assert headers == ["Bearer secret"]


def test_async_client_stream_and_errors() -> None:
    body = 'data: {"choices":[{"index":0,"delta":{"content":"A"},"finish_reason":null}]}\n\n' \
           'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(200, text=body)
        return error_response(404, "File Not Found")

    async def main() -> None:
        async with AsyncClient("http://srv", transport=httpx.MockTransport(handler)) as client:
            result = await client.chat_stream([{"role": "user", "content": "x"}])
            assert result.final["choices"][0]["message"]["content"] == "A"
            assert len(result.chunks) == 2
            with pytest.raises(HTTPError) as info:
                await client.props()
            assert info.value.status == 404

    asyncio.run(main())

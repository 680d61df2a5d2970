"""Client error mapping and request bodies, with httpx.MockTransport (no server)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from polykv_py.client import AsyncClient, Client, PoolFeatures, Share
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
    client.completion("p", n_predict=8, share=Share(0, 12), id_slot=2)
    client.completion("p", shared_pool_slot=1)  # raw fields (any value) go through the parameters
    client.completion("p", share=Share(3), shared_pool_slot=1)  # the share wins
    assert seen[0] == {"prompt": "p", "n_predict": 8, "shared_pool_slot": 0, "shared_prefix_n_tokens": 12, "id_slot": 2}
    assert seen[1] == {"prompt": "p", "shared_pool_slot": 1}
    assert seen[2] == {"prompt": "p", "shared_pool_slot": 3}


def test_api_key_header() -> None:
    headers: list[str | None] = []

    def record(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"status": "ok"})

    Client("http://srv", api_key="secret", transport=httpx.MockTransport(record)).health()
    assert headers == ["Bearer secret"]


def test_async_client_stream_and_errors() -> None:
    body = (
        'data: {"choices":[{"index":0,"delta":{"content":"A"},"finish_reason":null}]}\n\n'
        'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    )

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


def pool_server(seen: list[tuple[str, object]], props: dict | None = None) -> httpx.MockTransport:
    """Records (path with query, body); tokenizes one token per character; ``/props`` answers ``props``."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((f"{request.url.path}{'?' + request.url.query.decode() if request.url.query else ''}", body))
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [ord(c) for c in body["content"]]})
        if request.url.path == "/props":
            return httpx.Response(200, json=props or {"total_slots": 4})
        return httpx.Response(200, json={"ok": True})

    return httpx.MockTransport(handler)


POOL_STEPS = [
    ("/completion", {"prompt": "base", "n_predict": 0, "id_slot": 0, "cache_prompt": True, "temperature": 0.0}),
    ("/completion", {"prompt": [1, 2], "n_predict": 1, "cache_prompt": True, "temperature": 0.0}),
    ("/slots/2?action=erase", {}),
    ("/props", None),  # no "polykv" object: P is computed here
    ("/tokenize", {"content": "base", "add_special": True, "parse_special": True}),
    ("/tokenize", {"content": "base, and more", "add_special": True, "parse_special": True}),
    ("/completion", {"prompt": "base, and more", "id_slot": 1, "shared_pool_slot": 0, "shared_prefix_n_tokens": 4}),
]


def test_pool_steps_sync_and_async_send_the_same_requests() -> None:
    seen: list[tuple[str, object]] = []
    with Client("http://srv", transport=pool_server(seen)) as client:
        client.prime("base", 0)
        client.prime([1, 2], None, n_predict=1)
        client.erase_slot(2)
        client.share("base", "base, and more", id_slot=1)
    assert seen == POOL_STEPS

    async def main() -> None:
        async with AsyncClient("http://srv", transport=pool_server(seen)) as client:
            await client.prime("base", 0)
            await client.prime([1, 2], None, n_predict=1)
            await client.erase_slot(2)
            await client.share("base", "base, and more", id_slot=1)

    seen.clear()
    asyncio.run(main())
    assert seen == POOL_STEPS


NEW_PROPS = {"total_slots": 4, "polykv": {"pool_slots": [0, 1], "pool_auto": True, "pool_auto_min_tokens": 64}}


def test_pool_features_from_props() -> None:
    assert PoolFeatures.from_props({"total_slots": 4}) == PoolFeatures()
    assert not PoolFeatures().server_prefix
    got = PoolFeatures.from_props(NEW_PROPS)
    assert got == PoolFeatures(pool_slots=(0, 1), pool_auto=True, pool_auto_min_tokens=64, server_prefix=True)
    got.check_pool_slot(1)
    with pytest.raises(ValueError, match="slot 2 is not a reserved pool slot"):
        got.check_pool_slot(2)
    PoolFeatures().check_pool_slot(5)  # nothing known: nothing refused here
    assert PoolFeatures.from_props({"polykv": {}}) == PoolFeatures(server_prefix=True)


def test_share_leaves_p_to_a_server_that_computes_it_sync_and_async() -> None:
    """A server whose /props has "polykv" gets shared_pool_slot alone (no /tokenize calls); /props is read
    once per client."""
    steps = [
        ("/props", None),
        ("/completion", {"prompt": "base, and more", "id_slot": 1, "shared_pool_slot": 1}),
        ("/completion", {"prompt": "base, again", "shared_pool_slot": 0}),
    ]
    seen: list[tuple[str, object]] = []
    with Client("http://srv", transport=pool_server(seen, NEW_PROPS)) as client:
        assert client.share_for("base", "base, and more") == Share(0)
        client.share("base", "base, and more", pool_slot=1, id_slot=1)
        client.share("base", "base, again")
        assert client.pool_features().pool_auto
        assert client.pool_features(refresh=True).pool_slots == (0, 1)
    assert seen == [*steps, ("/props", None)]

    async def main() -> None:
        async with AsyncClient("http://srv", transport=pool_server(seen, NEW_PROPS)) as client:
            assert await client.share_for("base", "base, and more") == Share(0)
            await client.share("base", "base, and more", pool_slot=1, id_slot=1)
            await client.share("base", "base, again")
            assert (await client.pool_features()).pool_auto_min_tokens == 64

    seen.clear()
    asyncio.run(main())
    assert seen == steps


def test_share_without_n_tokens_leaves_the_field_out() -> None:
    assert Share(3).fields() == {"shared_pool_slot": 3}
    assert Share(3, 10).fields() == {"shared_pool_slot": 3, "shared_prefix_n_tokens": 10}


def test_async_failure_waits_for_the_exit_without_blocking_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a failed request waits for the server process to report its exit, other tasks run."""
    from polykv_py import client as client_module

    monkeypatch.setattr(client_module, "EXIT_WAIT_S", 0.3)

    class Running(FakeServer):
        returncode = None  # type: ignore[assignment]

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def main() -> tuple[int, ServerUnavailableError]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(ticker())
        async with AsyncClient("http://srv", transport=httpx.MockTransport(refuse), server=Running()) as client:
            try:
                await client.health()
            except ServerUnavailableError as exc:
                error = exc
        task.cancel()
        return ticks, error

    ticks, error = asyncio.run(main())
    assert ticks >= 10, ticks  # ~30 in 0.3 s; a blocking sleep would leave the ticker at 1
    assert "server process still running" in str(error) and error.exit_status is None

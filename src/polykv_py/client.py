"""HTTP clients (sync and async) for llama-server, including the shared-pool fields.

Both clients speak the same endpoints: health, props, slots, metrics, tokenize,
detokenize, apply-template, ``/completion``, ``/v1/completions`` and
``/v1/chat/completions``, each streamed (``*_stream``: the SSE chunks plus an
aggregated final result) or not.  An error answer raises
:class:`~polykv_py.errors.HTTPError` with the server's own message; a failed
connection raises :class:`~polykv_py.errors.ServerUnavailableError`, carrying the
server's log tail when the client belongs to a :class:`~polykv_py.server.LlamaServer`.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from .errors import HTTPError, ServerUnavailableError
from .tokens import shared_prefix_len

log = logging.getLogger(__name__)

#: Default per-request timeout in seconds (a long prefill on 2 cores takes a while).
DEFAULT_TIMEOUT = 600.0

Json = dict[str, Any]


#: No connection reuse. llama-server (cpp-httplib) closes kept-alive connections on its own
#: schedule; a request sent on one it is closing fails with "Server disconnected without
#: sending a response" (seen in the gate, 0.7 s into a run). Loopback connects cost ~0.1 ms.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


class _LogSource(Protocol):
    """What a client needs from its server to explain a failure."""

    @property
    def returncode(self) -> int | None: ...

    def log_tail(self, n: int = 40) -> str: ...


@dataclass
class StreamResult:
    """A streamed answer: every SSE ``data`` chunk, in order, and the aggregated result."""

    chunks: list[Json] = field(default_factory=list)
    final: Json = field(default_factory=dict)


# ---------------------------------------------------------------------- parsing
class SSEDecoder:
    """Incremental SSE decoder: feed lines, get the JSON payload of each complete event.

    Comment lines (``:`` pings) and ``event:`` names are skipped; multi-line ``data``
    fields are joined as the SSE spec says; ``data: [DONE]`` sets :attr:`done`.
    """

    def __init__(self) -> None:
        self._data: list[str] = []
        self.done = False

    def feed(self, raw: str) -> Json | None:
        """Feed one line; return the event's payload when the line completes an event."""
        line = raw.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> Json | None:
        """End the current event (also call at end of stream)."""
        if not self._data or self.done:
            self._data = []
            return None
        payload = "\n".join(self._data)
        self._data = []
        if payload.strip() == "[DONE]":
            self.done = True
            return None
        return json.loads(payload)


def parse_sse(lines: Iterable[str]) -> Iterator[Json]:
    """Yield the JSON payload of each SSE event in ``lines`` (stops at ``[DONE]``)."""
    dec = SSEDecoder()
    for line in lines:
        event = dec.feed(line)
        if event is not None:
            yield event
        if dec.done:
            return
    event = dec.flush()
    if event is not None:
        yield event


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus text exposition into ``{name or name{labels}: value}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:
            key, _, rest = line.rpartition("}")
            key += "}"
        else:
            key, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts:
            continue
        try:
            out[key.strip()] = float(parts[0])
        except ValueError:
            log.debug("skipping unparsable metrics line %r", line)
    return out


def error_message(body: bytes | str) -> str:
    """The server's message from an error body ``{"error": {"message": ...}}`` (else the text)."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    try:
        doc = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
    return text.strip()


def _raise_stream_error(chunk: Json, url: str) -> None:
    err = chunk.get("error")
    if isinstance(err, dict):
        code = err.get("code")
        raise HTTPError(code if isinstance(code, int) else 500, str(err.get("message", err)), url=url)


def aggregate_completion(chunks: list[Json]) -> Json:
    """Fold ``/completion`` stream chunks into one result shaped like the non-stream answer."""
    final: Json = {}
    content: list[str] = []
    tokens: list[int] = []
    probs: list[Any] = []
    for chunk in chunks:
        content.append(chunk.get("content", ""))
        tokens.extend(chunk.get("tokens", []))
        probs.extend(chunk.get("completion_probabilities", []))
        final.update(chunk)
    final["content"] = "".join(content)
    final["tokens"] = tokens
    if probs:
        final["completion_probabilities"] = probs
    return final


def aggregate_oai(chunks: list[Json], *, chat: bool) -> Json:
    """Fold ``/v1/chat/completions`` or ``/v1/completions`` stream chunks into one answer."""
    final: Json = {}
    choices: dict[int, Json] = {}
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            idx = int(choice.get("index", 0))
            agg = choices.setdefault(idx, {"index": idx, "finish_reason": None})
            if chat:
                msg = agg.setdefault("message", {"role": "assistant", "content": None})
                for key, value in (choice.get("delta") or {}).items():
                    if key == "role":
                        msg["role"] = value
                    elif isinstance(value, str):
                        msg[key] = (msg.get(key) or "") + value
                    elif key == "tool_calls":
                        msg.setdefault("tool_calls", []).extend(value)
                    elif value is not None:
                        msg[key] = value
            else:
                agg["text"] = agg.get("text", "") + (choice.get("text") or "")
            lp = choice.get("logprobs")
            if lp and lp.get("content"):
                agg.setdefault("logprobs", {"content": []})["content"].extend(lp["content"])
            if choice.get("finish_reason") is not None:
                agg["finish_reason"] = choice["finish_reason"]
        final.update({k: v for k, v in chunk.items() if k != "choices"})
    final["choices"] = [choices[i] for i in sorted(choices)]
    final["object"] = "chat.completion" if chat else "text_completion"
    return final


def _body(
    base: Json,
    *,
    shared_pool_slot: int | None,
    shared_prefix_n_tokens: int | None,
    extra: Mapping[str, Any] | None,
    params: Mapping[str, Any],
) -> Json:
    body = dict(base)
    body.update(params)
    if shared_pool_slot is not None:
        body["shared_pool_slot"] = shared_pool_slot
    if shared_prefix_n_tokens is not None:
        body["shared_prefix_n_tokens"] = shared_prefix_n_tokens
    if extra:
        body.update(extra)
    return body


#: How each generation endpoint's stream chunks aggregate into one final response.
_AGGREGATORS: dict[str, Callable[[list[Json]], Json]] = {
    "/completion": aggregate_completion,
    "/v1/completions": functools.partial(aggregate_oai, chat=False),
    "/v1/chat/completions": functools.partial(aggregate_oai, chat=True),
}


# ---------------------------------------------------------------------- clients
class _Base:
    def __init__(self, base_url: str, *, api_key: str | None, server: _LogSource | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.server = server
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _unavailable(self, exc: Exception, url: str) -> ServerUnavailableError:
        status = tail = None
        state = ""
        if self.server is not None:
            # a server that dropped the connection is often exiting: give it a moment to report how
            deadline = time.monotonic() + 1.0
            while (status := self.server.returncode) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            state = " (server process still running)" if status is None else " (server process exited)"
            tail = self.server.log_tail()
        what = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
        return ServerUnavailableError(
            f"request to {url} {what}: {type(exc).__name__}: {exc}{state}", exit_status=status, log_tail=tail or ""
        )

    def _check(self, resp: httpx.Response, body: bytes) -> None:
        if resp.status_code >= 400:
            raise HTTPError(resp.status_code, error_message(body), url=str(resp.request.url))


class Client(_Base):
    """Synchronous llama-server client."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        server: _LogSource | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, api_key=api_key, server=server)
        self._http = httpx.Client(
            base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport, trust_env=False,
            limits=NO_KEEPALIVE,
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport
    def request(self, method: str, path: str, body: Json | None = None) -> httpx.Response:
        """Send a request; raise on transport failure or an error status."""
        url = f"{self.base_url}{path}"
        try:
            resp = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise self._unavailable(exc, url) from exc
        self._check(resp, resp.content)
        return resp

    def get_json(self, path: str) -> Any:
        """GET ``path`` and decode JSON."""
        return self.request("GET", path).json()

    def post_json(self, path: str, body: Json) -> Any:
        """POST ``body`` to ``path`` and decode JSON."""
        return self.request("POST", path, body).json()

    def stream_events(self, path: str, body: Json) -> Iterator[Json]:
        """POST with ``stream: true`` and yield each SSE chunk (raises on an error event)."""
        url = f"{self.base_url}{path}"
        body = {**body, "stream": True}
        try:
            with self._http.stream("POST", path, json=body) as resp:
                if resp.status_code >= 400:
                    self._check(resp, resp.read())
                for chunk in parse_sse(resp.iter_lines()):
                    _raise_stream_error(chunk, url)
                    yield chunk
        except httpx.TransportError as exc:
            raise self._unavailable(exc, url) from exc

    def _stream_result(self, path: str, body: Json) -> StreamResult:
        chunks = list(self.stream_events(path, body))
        return StreamResult(chunks, _AGGREGATORS[path](copy.deepcopy(chunks)))

    # -- endpoints
    def health(self) -> Json:
        """``GET /health`` (raises HTTPError 503 while loading)."""
        return self.get_json("/health")

    def props(self) -> Json:
        """``GET /props``."""
        return self.get_json("/props")

    def slots(self) -> list[Json]:
        """``GET /slots``."""
        return self.get_json("/slots")

    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` parsed into a dict (server needs ``--metrics``)."""
        return parse_metrics(self.request("GET", "/metrics").text)

    def tokenize(
        self, content: str, *, add_special: bool = False, parse_special: bool = True, with_pieces: bool = False
    ) -> list[Any]:
        """``POST /tokenize``: token ids, or ``{"id", "piece"}`` dicts with ``with_pieces``."""
        body = {"content": content, "add_special": add_special, "parse_special": parse_special}
        if with_pieces:
            body["with_pieces"] = True
        return self.post_json("/tokenize", body)["tokens"]

    def detokenize(self, tokens: list[int]) -> str:
        """``POST /detokenize``."""
        return self.post_json("/detokenize", {"tokens": tokens})["content"]

    def apply_template(self, messages: list[Json], **params: Any) -> str:
        """``POST /apply-template``: the chat prompt the server would build."""
        return self.post_json("/apply-template", {"messages": messages, **params})["prompt"]

    def prompt_tokens(self, prompt: str) -> list[int]:
        """The tokens ``/completion`` will evaluate for ``prompt`` (special tokens added and parsed)."""
        return self.tokenize(prompt, add_special=True, parse_special=True)

    def shared_prefix_len(self, pool_prompt: str, prompt: str) -> int:
        """P for a sharer of ``pool_prompt`` (:func:`polykv_py.tokens.shared_prefix_len` of the tokenized prompts)."""
        return shared_prefix_len(self.prompt_tokens(pool_prompt), self.prompt_tokens(prompt))

    def completion(
        self,
        prompt: str | list[Any],
        *,
        shared_pool_slot: int | None = None,
        shared_prefix_n_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> Json:
        """``POST /completion`` (non-stream)."""
        body = _body({"prompt": prompt}, shared_pool_slot=shared_pool_slot,
                     shared_prefix_n_tokens=shared_prefix_n_tokens, extra=extra, params=params)
        return self.post_json("/completion", body)

    def completion_stream(
        self,
        prompt: str | list[Any],
        *,
        shared_pool_slot: int | None = None,
        shared_prefix_n_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> StreamResult:
        """``POST /completion`` streamed: the chunks and their aggregate."""
        body = _body({"prompt": prompt}, shared_pool_slot=shared_pool_slot,
                     shared_prefix_n_tokens=shared_prefix_n_tokens, extra=extra, params=params)
        return self._stream_result("/completion", body)

    def oai_completion(
        self,
        prompt: str | list[Any],
        *,
        shared_pool_slot: int | None = None,
        shared_prefix_n_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> Json:
        """``POST /v1/completions`` (non-stream)."""
        body = _body({"prompt": prompt}, shared_pool_slot=shared_pool_slot,
                     shared_prefix_n_tokens=shared_prefix_n_tokens, extra=extra, params=params)
        return self.post_json("/v1/completions", body)

    def oai_completion_stream(
        self,
        prompt: str | list[Any],
        *,
        shared_pool_slot: int | None = None,
        shared_prefix_n_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> StreamResult:
        """``POST /v1/completions`` streamed."""
        body = _body({"prompt": prompt}, shared_pool_slot=shared_pool_slot,
                     shared_prefix_n_tokens=shared_prefix_n_tokens, extra=extra, params=params)
        return self._stream_result("/v1/completions", body)

    def chat(
        self,
        messages: list[Json],
        *,
        shared_pool_slot: int | None = None,
        shared_prefix_n_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> Json:
        """``POST /v1/chat/completions`` (non-stream)."""
        body = _body({"messages": messages}, shared_pool_slot=shared_pool_slot,
                     shared_prefix_n_tokens=shared_prefix_n_tokens, extra=extra, params=params)
        return self.post_json("/v1/chat/completions", body)

    def chat_stream(
        self,
        messages: list[Json],
        *,
        shared_pool_slot: int | None = None,
        shared_prefix_n_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> StreamResult:
        """``POST /v1/chat/completions`` streamed."""
        body = _body({"messages": messages}, shared_pool_slot=shared_pool_slot,
                     shared_prefix_n_tokens=shared_prefix_n_tokens, extra=extra, params=params)
        return self._stream_result("/v1/chat/completions", body)


class AsyncClient(_Base):
    """Asynchronous llama-server client (same methods as :class:`Client`, awaitable)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        server: _LogSource | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 64,
    ) -> None:
        super().__init__(base_url, api_key=api_key, server=server)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=self._headers,
            timeout=timeout,
            transport=transport,
            trust_env=False,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=0),
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- transport
    async def request(self, method: str, path: str, body: Json | None = None) -> httpx.Response:
        """Send a request; raise on transport failure or an error status."""
        url = f"{self.base_url}{path}"
        try:
            resp = await self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise self._unavailable(exc, url) from exc
        self._check(resp, resp.content)
        return resp

    async def get_json(self, path: str) -> Any:
        """GET ``path`` and decode JSON."""
        return (await self.request("GET", path)).json()

    async def post_json(self, path: str, body: Json) -> Any:
        """POST ``body`` to ``path`` and decode JSON."""
        return (await self.request("POST", path, body)).json()

    async def stream_events(self, path: str, body: Json) -> AsyncIterator[Json]:
        """POST with ``stream: true`` and yield each SSE chunk (raises on an error event)."""
        url = f"{self.base_url}{path}"
        body = {**body, "stream": True}
        try:
            async with self._http.stream("POST", path, json=body) as resp:
                if resp.status_code >= 400:
                    self._check(resp, await resp.aread())
                dec = SSEDecoder()
                async for line in resp.aiter_lines():
                    event = dec.feed(line)
                    if event is not None:
                        _raise_stream_error(event, url)
                        yield event
                    if dec.done:
                        return
                event = dec.flush()
                if event is not None:
                    _raise_stream_error(event, url)
                    yield event
        except httpx.TransportError as exc:
            raise self._unavailable(exc, url) from exc

    async def _stream_result(self, path: str, body: Json) -> StreamResult:
        chunks = [chunk async for chunk in self.stream_events(path, body)]
        return StreamResult(chunks, _AGGREGATORS[path](copy.deepcopy(chunks)))

    # -- endpoints
    async def health(self) -> Json:
        """``GET /health``."""
        return await self.get_json("/health")

    async def props(self) -> Json:
        """``GET /props``."""
        return await self.get_json("/props")

    async def slots(self) -> list[Json]:
        """``GET /slots``."""
        return await self.get_json("/slots")

    async def metrics(self) -> dict[str, float]:
        """``GET /metrics`` parsed into a dict."""
        return parse_metrics((await self.request("GET", "/metrics")).text)

    async def tokenize(
        self, content: str, *, add_special: bool = False, parse_special: bool = True, with_pieces: bool = False
    ) -> list[Any]:
        """``POST /tokenize``."""
        body = {"content": content, "add_special": add_special, "parse_special": parse_special}
        if with_pieces:
            body["with_pieces"] = True
        return (await self.post_json("/tokenize", body))["tokens"]

    async def detokenize(self, tokens: list[int]) -> str:
        """``POST /detokenize``."""
        return (await self.post_json("/detokenize", {"tokens": tokens}))["content"]

    async def apply_template(self, messages: list[Json], **params: Any) -> str:
        """``POST /apply-template``."""
        return (await self.post_json("/apply-template", {"messages": messages, **params}))["prompt"]

    async def prompt_tokens(self, prompt: str) -> list[int]:
        """The tokens ``/completion`` will evaluate for ``prompt``."""
        return await self.tokenize(prompt, add_special=True, parse_special=True)

    async def shared_prefix_len(self, pool_prompt: str, prompt: str) -> int:
        """P for a sharer of ``pool_prompt`` (:func:`polykv_py.tokens.shared_prefix_len` of the tokenized prompts)."""
        return shared_prefix_len(await self.prompt_tokens(pool_prompt), await self.prompt_tokens(prompt))

    async def completion(
        self,
        prompt: str | list[Any],
        *,
        shared_pool_slot: int | None = None,
        shared_prefix_n_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> Json:
        """``POST /completion`` (non-stream)."""
        body = _body({"prompt": prompt}, shared_pool_slot=shared_pool_slot,
                     shared_prefix_n_tokens=shared_prefix_n_tokens, extra=extra, params=params)
        return await self.post_json("/completion", body)

    async def completion_stream(
        self,
        prompt: str | list[Any],
        *,
        shared_pool_slot: int | None = None,
        shared_prefix_n_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> StreamResult:
        """``POST /completion`` streamed."""
        body = _body({"prompt": prompt}, shared_pool_slot=shared_pool_slot,
                     shared_prefix_n_tokens=shared_prefix_n_tokens, extra=extra, params=params)
        return await self._stream_result("/completion", body)

    async def oai_completion(
        self,
        prompt: str | list[Any],
        *,
        shared_pool_slot: int | None = None,
        shared_prefix_n_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> Json:
        """``POST /v1/completions`` (non-stream)."""
        body = _body({"prompt": prompt}, shared_pool_slot=shared_pool_slot,
                     shared_prefix_n_tokens=shared_prefix_n_tokens, extra=extra, params=params)
        return await self.post_json("/v1/completions", body)

    async def oai_completion_stream(
        self,
        prompt: str | list[Any],
        *,
        shared_pool_slot: int | None = None,
        shared_prefix_n_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> StreamResult:
        """``POST /v1/completions`` streamed."""
        body = _body({"prompt": prompt}, shared_pool_slot=shared_pool_slot,
                     shared_prefix_n_tokens=shared_prefix_n_tokens, extra=extra, params=params)
        return await self._stream_result("/v1/completions", body)

    async def chat(
        self,
        messages: list[Json],
        *,
        shared_pool_slot: int | None = None,
        shared_prefix_n_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> Json:
        """``POST /v1/chat/completions`` (non-stream)."""
        body = _body({"messages": messages}, shared_pool_slot=shared_pool_slot,
                     shared_prefix_n_tokens=shared_prefix_n_tokens, extra=extra, params=params)
        return await self.post_json("/v1/chat/completions", body)

    async def chat_stream(
        self,
        messages: list[Json],
        *,
        shared_pool_slot: int | None = None,
        shared_prefix_n_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> StreamResult:
        """``POST /v1/chat/completions`` streamed."""
        body = _body({"messages": messages}, shared_pool_slot=shared_pool_slot,
                     shared_prefix_n_tokens=shared_prefix_n_tokens, extra=extra, params=params)
        return await self._stream_result("/v1/chat/completions", body)

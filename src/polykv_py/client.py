"""HTTP clients (sync and async) for llama-server, including the shared-pool fields.

Both clients speak the same endpoints: health, props, slots, metrics, tokenize,
detokenize, apply-template, ``/completion``, ``/v1/completions`` and
``/v1/chat/completions``, each streamed (``*_stream``: the SSE chunks plus an
aggregated final result) or not, and the pool's own steps: :meth:`Client.prime`,
:meth:`Client.share`, :meth:`Client.erase_slot`, and what the server offers for pools
(:meth:`Client.pool_features`: whether it computes P itself, ``--pool-auto``).  An error answer raises
:class:`~polykv_py.errors.HTTPError` with the server's own message; a failed
connection raises :class:`~polykv_py.errors.ServerUnavailableError`, carrying the
server's log tail when the client belongs to a :class:`~polykv_py.llama_server.LlamaServer`.

Every request is built once, as a :class:`Request` (method, path, body and how to
read the answer); :class:`Client` and :class:`AsyncClient` only send it, each method
one line of I/O.  The sharing fields travel as one value, :class:`Share`.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import time
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypedDict, TypeVar, Unpack

import httpx

from .errors import HTTPError, ServerUnavailableError
from .jsontypes import Json
from .pools import PoolState, action_body, pool_states
from .tokens import shared_prefix_len

log = logging.getLogger(__name__)

#: Default per-request timeout in seconds (a long prefill on 2 cores takes a while).
DEFAULT_TIMEOUT = 600.0
#: How long a failed request waits for the server process to report its exit (it is often exiting).
EXIT_WAIT_S = 1.0
EXIT_POLL_S = 0.05

#: The response header naming the replica a gateway (smg) sent a request to (its URL).
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"
#: A prompt: text, or token ids (mixed lists too, as llama-server accepts them).
Prompt = str | list[Any]
T = TypeVar("T")

#: The generation endpoints.
COMPLETION = "/completion"
OAI_COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"

#: No connection reuse. llama-server (cpp-httplib) closes kept-alive connections on its own
#: schedule; a request sent on one it is closing fails with "Server disconnected without
#: sending a response" (seen in the gate, 0.7 s into a run). Loopback connects cost ~0.1 ms.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


class _LogSource(Protocol):
    """What a client needs from its server to explain a failure."""

    @property
    def returncode(self) -> int | None: ...

    def log_tail(self, n: int = 40) -> str: ...


@dataclass(frozen=True)
class Share:
    """The request fields that share a pool slot's KV: ``shared_pool_slot`` and ``shared_prefix_n_tokens``.

    ``n_tokens`` is P, the common prefix of the *tokenized* pool prompt and the tokenized
    prompt (:meth:`Client.shared_prefix_len`); None leaves the field out: a server whose
    ``/props`` has a ``polykv`` object (:attr:`PoolFeatures.server_prefix`) then computes P
    itself (``shared_prefix.requested`` null, ``auto`` ``"prefix"``), an older patched server
    shares nothing (status ``no_prefix``). :meth:`Client.share_for` picks the right one.
    """

    pool_slot: int
    n_tokens: int | None = None

    def fields(self) -> Json:
        """The fields as they go into a request body (e.g. the OpenAI client's ``extra_body``)."""
        out: Json = {"shared_pool_slot": self.pool_slot}
        if self.n_tokens is not None:
            out["shared_prefix_n_tokens"] = self.n_tokens
        return out


@dataclass(frozen=True)
class PoolFeatures:
    """What a patched server says about its pools: the ``"polykv"`` object of ``GET /props``.

    A server started with ``--pool-slots`` by a patch that computes P itself reports
    ``{"pool_slots": [...], "pool_auto": bool, "pool_auto_min_tokens": N}``. Any other server
    (an older patch, no ``--pool-slots``, the reference) has no such object: the defaults here,
    and a client must send P itself.
    """

    #: The reserved pool slots (``--pool-slots``); a share must name one of them (else HTTP 400).
    pool_slots: tuple[int, ...] = ()
    #: ``--pool-auto``: a plain request (no pool field, not pinned) shares the best reserved pool.
    pool_auto: bool = False
    #: The shortest common prefix, in tokens, that ``--pool-auto`` shares.
    pool_auto_min_tokens: int | None = None
    #: The server computes P when a request names ``shared_pool_slot`` without ``shared_prefix_n_tokens``.
    server_prefix: bool = False
    #: What a pool file must match on this server (format, model, KV layout; patch 0075), None without
    #: pool files: :func:`polykv_py.pools.pool_file_name` names cache files from it.
    pool_files: Json | None = None
    #: ``--share-any`` (patch 0077): any computed prefix is shared, and hot ones are promoted into free pools.
    share_any: bool = False

    @classmethod
    def from_props(cls, props: Json) -> PoolFeatures:
        """The features in a ``/props`` answer (the defaults when it has no ``polykv`` object)."""
        info = props.get("polykv")
        if not isinstance(info, dict):
            return cls()
        min_tokens = info.get("pool_auto_min_tokens")
        return cls(
            pool_slots=tuple(int(s) for s in info.get("pool_slots") or ()),
            pool_auto=bool(info.get("pool_auto")),
            pool_auto_min_tokens=min_tokens if isinstance(min_tokens, int) else None,
            server_prefix=True,
            pool_files=files if isinstance(files := info.get("pool_files"), dict) else None,
            share_any=bool(info.get("share_any")),
        )

    def check_pool_slot(self, slot: int) -> None:
        """Raise ValueError when the server reserves pools and ``slot`` is not one of them."""
        if self.pool_slots and slot not in self.pool_slots:
            raise ValueError(f"slot {slot} is not a reserved pool slot of this server (--pool-slots {self.pool_slots})")


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
            self._data.append(value.removeprefix(" "))
        return None

    def events(self, raw: str) -> tuple[Json, ...]:
        """:meth:`feed` as a tuple of the events the line completes (none or one); ``""`` ends the stream."""
        event = self.feed(raw)
        return () if event is None else (event,)

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
        yield from dec.events(line)
        if dec.done:
            return
    yield from dec.events("")


async def aparse_sse(lines: AsyncIterable[str]) -> AsyncIterator[Json]:
    """:func:`parse_sse` over an async line iterator (e.g. ``httpx.Response.aiter_lines()``)."""
    dec = SSEDecoder()
    async for line in lines:
        for event in dec.events(line):
            yield event
        if dec.done:
            return
    for event in dec.events(""):
        yield event


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus text exposition into ``{name or name{labels}: value}``."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
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


def _raise_stream_error(chunk: Json, url: str) -> Json:
    """``chunk``, unless it is an error event: then the HTTPError it reports."""
    err = chunk.get("error")
    if isinstance(err, dict):
        code = err.get("code")
        raise HTTPError(code if isinstance(code, int) else 500, str(err.get("message", err)), url=url)
    return chunk


def chunk_finishes(chunk: Json) -> bool:
    """True for the chunk that ends an answer: ``stop: true`` (``/completion``) or a ``finish_reason``."""
    if chunk.get("stop") is True:
        return True
    return any(c.get("finish_reason") for c in chunk.get("choices") or [] if isinstance(c, dict))


def _incomplete(url: str) -> ServerUnavailableError:
    """The error for a stream that ended before its final chunk (the server or a gateway's replica went away)."""
    return ServerUnavailableError(f"the answer stream from {url} ended before the answer was complete")


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


def _fold_delta(msg: Json, delta: Json) -> None:
    """Add one chat ``delta`` to the message being assembled."""
    for key, value in delta.items():
        if key == "role":
            msg["role"] = value
        elif isinstance(value, str):
            msg[key] = (msg.get(key) or "") + value
        elif key == "tool_calls":
            msg.setdefault("tool_calls", []).extend(value)
        elif value is not None:
            msg[key] = value


def aggregate_oai(chunks: list[Json], *, chat: bool) -> Json:
    """Fold ``/v1/chat/completions`` or ``/v1/completions`` stream chunks into one answer."""
    final: Json = {}
    choices: dict[int, Json] = {}
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            idx = int(choice.get("index", 0))
            agg = choices.setdefault(idx, {"index": idx, "finish_reason": None})
            if chat:
                _fold_delta(
                    agg.setdefault("message", {"role": "assistant", "content": None}), choice.get("delta") or {}
                )
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


#: How each generation endpoint's stream chunks aggregate into one final response.
_AGGREGATORS: dict[str, Callable[[list[Json]], Json]] = {
    COMPLETION: aggregate_completion,
    OAI_COMPLETION: functools.partial(aggregate_oai, chat=False),
    CHAT: functools.partial(aggregate_oai, chat=True),
}


def aggregate(path: str, chunks: Iterable[Json]) -> Json:
    """The final answer of a stream from the generation endpoint ``path``, folded from its chunks.

    The chunks are copied first: the result shares nothing with them.
    """
    return _AGGREGATORS[path](copy.deepcopy(list(chunks)))


def stream_result(path: str, chunks: list[Json]) -> StreamResult:
    """The chunks of a stream from ``path`` and their aggregate."""
    return StreamResult(chunks, aggregate(path, chunks))


# ---------------------------------------------------------------------- requests
def _json(resp: httpx.Response) -> Any:
    return resp.json()


def _response(resp: httpx.Response) -> httpx.Response:
    return resp


def _metrics(resp: httpx.Response) -> dict[str, float]:
    return parse_metrics(resp.text)


def _field(name: str) -> Callable[[httpx.Response], Any]:
    return lambda resp: resp.json()[name]


@dataclass(frozen=True)
class Request(Generic[T]):
    """One request, built once for either client: what to send, and how to read the answer."""

    method: str
    path: str
    body: Json | None = None
    parse: Callable[[httpx.Response], T] = _json
    headers: Mapping[str, str] | None = None  # besides the client's own (e.g. a gateway's routing key)

    @staticmethod
    def get(path: str) -> Request[Any]:
        """``GET path``, answer decoded from JSON."""
        return Request("GET", path)

    @staticmethod
    def post(path: str, body: Json, parse: Callable[[httpx.Response], Any] = _json) -> Request[Any]:
        """``POST body`` to ``path``, answer decoded from JSON (or read by ``parse``)."""
        return Request("POST", path, body, parse)

    @staticmethod
    def stream(path: str, body: Json, headers: Mapping[str, str] | None = None) -> Request[Any]:
        """``POST body`` with ``stream: true``: the answer is a stream of SSE chunks."""
        return Request("POST", path, {**body, "stream": True}, headers=headers)


def generation_body(key: str, first: Any, share: Share | None, params: dict[str, Any]) -> Json:
    """A generation request's body: ``{key: first}``, the request parameters, then the sharing fields."""
    return {key: first, **params, **(share.fields() if share is not None else {})}


def tokenize_request(content: str, *, add_special: bool, parse_special: bool, with_pieces: bool) -> Request[Any]:
    """``POST /tokenize``: token ids, or ``{"id", "piece"}`` dicts with ``with_pieces``."""
    body: Json = {"content": content, "add_special": add_special, "parse_special": parse_special}
    if with_pieces:
        body["with_pieces"] = True
    return Request.post("/tokenize", body, _field("tokens"))


def prompt_tokens_request(prompt: str) -> Request[Any]:
    """The tokens ``/completion`` evaluates for ``prompt`` (special tokens added and parsed)."""
    return tokenize_request(prompt, add_special=True, parse_special=True, with_pieces=False)


def prime_request(prompt: Prompt, slot: int | None, params: dict[str, Any]) -> Request[Any]:
    """``POST /completion`` that fills ``slot`` with ``prompt``: processed and cached, nothing generated.

    ``slot=None`` leaves the slot to the server; ``params`` override the defaults.
    """
    pin = {} if slot is None else {"id_slot": slot}
    body = {"prompt": prompt, "n_predict": 0, **pin, "cache_prompt": True, "temperature": 0.0, **params}
    return Request.post(COMPLETION, body)


def pool_file_request(action: str, slot: int, filename: str, **fields: Any) -> Request[Any]:
    """``POST /slots/{slot}?action=save|restore`` of a reserved pool (patch 0075; the server needs
    ``--slot-save-path``). A restore verifies the file and, if given, that it holds ``tokens``
    and was primed under ``cache_salt``; a refusal is HTTP 400 naming the reason (a file that does
    not match the salt is refused without detail). ``fields``: :func:`~polykv_py.pools.action_body`'s."""
    return Request.post(f"/slots/{slot}?action={action}", action_body(filename, **fields))


class RestoreFields(TypedDict, total=False):
    """What a pool restore may check and mark: the pool must hold ``tokens`` and have been primed under
    ``cache_salt``; ``promoted`` marks it as a ``--share-any`` promoted prefix."""

    tokens: Sequence[int] | None
    cache_salt: str | None
    promoted: bool | None


def erase_request(slot: int) -> Request[Any]:
    """``POST /slots/{slot}?action=erase``: empty a slot's KV (the server needs ``--slot-save-path``)."""
    return Request.post(f"/slots/{slot}?action=erase", {})


HEALTH = Request.get("/health")
PROPS = Request.get("/props")
SLOTS = Request.get("/slots")
METRICS = Request("GET", "/metrics", parse=_metrics)


# ---------------------------------------------------------------------- clients
class ClientOptions(TypedDict, total=False):
    """The options both clients take: ``api_key`` (sent as a bearer token), ``timeout`` (seconds a request
    may wait for the next bytes), ``server`` (the process behind the URL: a failed request then says
    whether it exited, with its exit status and log tail) and ``headers`` (sent with every request, e.g.
    a gateway's routing key, :data:`polykv_py.gateway.ROUTING_KEY_HEADER`)."""

    api_key: str | None
    timeout: float
    server: _LogSource | None
    headers: Mapping[str, str] | None


class _Base:
    """What both clients share: the address, the key, and how an answer or a failure is read."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        server: _LogSource | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.server = server
        self._pool_features: PoolFeatures | None = None
        self._headers = {**(headers or {}), **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        #: what either httpx client is made with (no proxies from the environment: the server is local)
        self._http_options: dict[str, Any] = {
            "base_url": self.base_url,
            "headers": self._headers,
            "timeout": timeout,
            "trust_env": False,
        }

    def _exit_pending(self, deadline: float) -> bool:
        """True while the server process still runs and the wait for its exit has time left."""
        return self.server is not None and self.server.returncode is None and time.monotonic() < deadline

    def _unavailable(self, exc: Exception, path: str) -> ServerUnavailableError:
        """The error for a failed connection (call after waiting for the process to report its exit)."""
        status = tail = None
        state = ""
        if self.server is not None:
            status = self.server.returncode
            state = " (server process still running)" if status is None else " (server process exited)"
            tail = self.server.log_tail()
        what = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
        return ServerUnavailableError(
            f"request to {self.base_url}{path} {what}: {type(exc).__name__}: {exc}{state}",
            exit_status=status,
            log_tail=tail or "",
        )

    @staticmethod
    def _check(resp: httpx.Response, body: bytes) -> None:
        if resp.status_code >= 400:
            raise HTTPError(resp.status_code, error_message(body), url=str(resp.request.url))

    def _read(self, req: Request[T], resp: httpx.Response) -> T:
        self._check(resp, resp.content)
        return req.parse(resp)

    def _chunk(self, chunk: Json, req: Request[Any]) -> Json:
        return _raise_stream_error(chunk, f"{self.base_url}{req.path}")


class Client(_Base):
    """Synchronous llama-server client."""

    def __init__(
        self, base_url: str, *, transport: httpx.BaseTransport | None = None, **options: Unpack[ClientOptions]
    ) -> None:
        super().__init__(base_url, **options)
        self._http = httpx.Client(transport=transport, limits=NO_KEEPALIVE, **self._http_options)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport
    def _failed(self, exc: Exception, path: str) -> ServerUnavailableError:
        deadline = time.monotonic() + EXIT_WAIT_S  # a server that dropped the connection is often exiting
        while self._exit_pending(deadline):
            time.sleep(EXIT_POLL_S)
        return self._unavailable(exc, path)

    def send(self, req: Request[T]) -> T:
        """Send ``req`` and read its answer; raise on transport failure or an error status."""
        try:
            resp = self._http.request(req.method, req.path, json=req.body, headers=req.headers)
        except httpx.TransportError as exc:
            raise self._failed(exc, req.path) from exc
        return self._read(req, resp)

    def events(self, req: Request[Any], meta: MutableMapping[str, Any] | None = None) -> Iterator[Json]:
        """Send the stream request ``req`` and yield each SSE chunk (raises on an error event, and when the
        stream ends before its final chunk). ``meta["headers"]`` receives the response headers."""
        finished = False
        try:
            with self._http.stream(req.method, req.path, json=req.body, headers=req.headers) as resp:
                if meta is not None:
                    meta["headers"] = resp.headers
                if resp.status_code >= 400:
                    self._check(resp, resp.read())
                for chunk in parse_sse(resp.iter_lines()):
                    finished = finished or chunk_finishes(chunk)
                    yield self._chunk(chunk, req)
        except httpx.TransportError as exc:
            raise self._failed(exc, req.path) from exc
        if not finished:
            raise _incomplete(f"{self.base_url}{req.path}")

    def _stream_result(self, path: str, body: Json) -> StreamResult:
        return stream_result(path, list(self.events(Request.stream(path, body))))

    def request(self, method: str, path: str, body: Json | None = None) -> httpx.Response:
        """Send a request; raise on transport failure or an error status."""
        return self.send(Request(method, path, body, _response))

    def get_json(self, path: str) -> Any:
        """GET ``path`` and decode JSON."""
        return self.send(Request.get(path))

    def post_json(self, path: str, body: Json) -> Any:
        """POST ``body`` to ``path`` and decode JSON."""
        return self.send(Request.post(path, body))

    def stream_events(self, path: str, body: Json) -> Iterator[Json]:
        """POST with ``stream: true`` and yield each SSE chunk (raises on an error event)."""
        return self.events(Request.stream(path, body))

    # -- endpoints
    def health(self) -> Json:
        """``GET /health`` (raises HTTPError 503 while loading)."""
        return self.send(HEALTH)

    def props(self) -> Json:
        """``GET /props``."""
        return self.send(PROPS)

    def pool_features(self, *, refresh: bool = False) -> PoolFeatures:
        """What the server offers for pools (``/props``), read once per client unless ``refresh``."""
        if self._pool_features is None or refresh:
            self._pool_features = PoolFeatures.from_props(self.props())
        return self._pool_features

    def slots(self) -> list[Json]:
        """``GET /slots``."""
        return self.send(SLOTS)

    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` parsed into a dict (server needs ``--metrics``)."""
        return self.send(METRICS)

    def tokenize(
        self, content: str, *, add_special: bool = False, parse_special: bool = True, with_pieces: bool = False
    ) -> list[Any]:
        """``POST /tokenize``: token ids, or ``{"id", "piece"}`` dicts with ``with_pieces``."""
        req = tokenize_request(content, add_special=add_special, parse_special=parse_special, with_pieces=with_pieces)
        return self.send(req)

    def detokenize(self, tokens: list[int]) -> str:
        """``POST /detokenize``."""
        return self.send(Request.post("/detokenize", {"tokens": tokens}, _field("content")))

    def apply_template(self, messages: list[Json], **params: Any) -> str:
        """``POST /apply-template``: the chat prompt the server would build."""
        return self.send(Request.post("/apply-template", {"messages": messages, **params}, _field("prompt")))

    def prompt_tokens(self, prompt: str) -> list[int]:
        """The tokens ``/completion`` will evaluate for ``prompt`` (special tokens added and parsed)."""
        return self.send(prompt_tokens_request(prompt))

    def shared_prefix_len(self, pool_prompt: str, prompt: str) -> int:
        """P for a sharer of ``pool_prompt`` (:func:`polykv_py.tokens.shared_prefix_len` of the tokenized prompts)."""
        return shared_prefix_len(self.prompt_tokens(pool_prompt), self.prompt_tokens(prompt))

    def completion(self, prompt: Prompt, *, share: Share | None = None, **params: Any) -> Json:
        """``POST /completion`` (non-stream); ``params`` go into the body as they are."""
        return self.post_json(COMPLETION, generation_body("prompt", prompt, share, params))

    def completion_stream(self, prompt: Prompt, *, share: Share | None = None, **params: Any) -> StreamResult:
        """``POST /completion`` streamed: the chunks and their aggregate."""
        return self._stream_result(COMPLETION, generation_body("prompt", prompt, share, params))

    def oai_completion(self, prompt: Prompt, *, share: Share | None = None, **params: Any) -> Json:
        """``POST /v1/completions`` (non-stream)."""
        return self.post_json(OAI_COMPLETION, generation_body("prompt", prompt, share, params))

    def oai_completion_stream(self, prompt: Prompt, *, share: Share | None = None, **params: Any) -> StreamResult:
        """``POST /v1/completions`` streamed."""
        return self._stream_result(OAI_COMPLETION, generation_body("prompt", prompt, share, params))

    def chat(self, messages: list[Json], *, share: Share | None = None, **params: Any) -> Json:
        """``POST /v1/chat/completions`` (non-stream)."""
        return self.post_json(CHAT, generation_body("messages", messages, share, params))

    def chat_stream(self, messages: list[Json], *, share: Share | None = None, **params: Any) -> StreamResult:
        """``POST /v1/chat/completions`` streamed."""
        return self._stream_result(CHAT, generation_body("messages", messages, share, params))

    # -- the pool
    def prime(self, prompt: Prompt, slot: int | None, **params: Any) -> Json:
        """Fill ``slot`` with ``prompt`` (processed and cached, nothing generated; None: any slot)."""
        return self.send(prime_request(prompt, slot, params))

    def share_for(self, pool_prompt: str, prompt: str, *, pool_slot: int = 0) -> Share:
        """The sharing fields for ``prompt`` over ``pool_slot``, which holds ``pool_prompt``.

        P is left to the server when it computes it (:attr:`PoolFeatures.server_prefix`), else it
        is :meth:`shared_prefix_len` of the two prompts.
        """
        if self.pool_features().server_prefix:
            return Share(pool_slot)
        return Share(pool_slot, self.shared_prefix_len(pool_prompt, prompt))

    def share(self, pool_prompt: str, prompt: str, *, pool_slot: int = 0, **params: Any) -> Json:
        """``POST /completion`` of ``prompt`` sharing the first P tokens of ``pool_slot``, which holds ``pool_prompt``.

        P as :meth:`share_for` gives it (the server's own, or computed here).
        """
        return self.completion(prompt, share=self.share_for(pool_prompt, prompt, pool_slot=pool_slot), **params)

    def erase_slot(self, slot: int) -> Json:
        """Empty ``slot``'s KV (``POST /slots/{slot}?action=erase``; the server needs ``--slot-save-path``)."""
        return self.send(erase_request(slot))

    def save_pool(
        self, slot: int, filename: str, *, cache_salt: str | None = None, sha256_of_tokens: str | None = None
    ) -> Json:
        """Save reserved pool ``slot`` to ``filename`` in the server's ``--slot-save-path`` (atomic;
        ``cache_salt``: the salt the pool was primed under; ``sha256_of_tokens``: refused unless the
        pool holds those tokens)."""
        fields = {"cache_salt": cache_salt, "sha256_of_tokens": sha256_of_tokens}
        return self.send(pool_file_request("save", slot, filename, **fields))

    def restore_pool(self, slot: int, filename: str, **fields: Unpack[RestoreFields]) -> Json:
        """Restore reserved pool ``slot`` from ``filename`` (verified; see :func:`pool_file_request` and
        :class:`RestoreFields`)."""
        return self.send(pool_file_request("restore", slot, filename, **fields))

    def pools(self) -> list[PoolState]:
        """The reserved pools' states: resident, salted, tokens (a hash, or a MAC keyed with the salt), hits,
        sharers, last use."""
        return pool_states(self.slots())


class AsyncClient(_Base):
    """Asynchronous llama-server client (same methods as :class:`Client`, awaitable).

    ``max_connections`` bounds the requests in flight.
    """

    def __init__(
        self,
        base_url: str,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 64,
        **options: Unpack[ClientOptions],
    ) -> None:
        super().__init__(base_url, **options)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=0)
        self._http = httpx.AsyncClient(transport=transport, limits=limits, **self._http_options)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- transport
    async def _failed(self, exc: Exception, path: str) -> ServerUnavailableError:
        deadline = time.monotonic() + EXIT_WAIT_S  # never block the event loop while the process exits
        while self._exit_pending(deadline):
            await asyncio.sleep(EXIT_POLL_S)
        return self._unavailable(exc, path)

    async def send(self, req: Request[T]) -> T:
        """Send ``req`` and read its answer; raise on transport failure or an error status."""
        try:
            resp = await self._http.request(req.method, req.path, json=req.body, headers=req.headers)
        except httpx.TransportError as exc:
            raise await self._failed(exc, req.path) from exc
        return self._read(req, resp)

    async def events(self, req: Request[Any], meta: MutableMapping[str, Any] | None = None) -> AsyncIterator[Json]:
        """Send the stream request ``req`` and yield each SSE chunk (raises on an error event, and when the
        stream ends before its final chunk). ``meta["headers"]`` receives the response headers."""
        finished = False
        try:
            async with self._http.stream(req.method, req.path, json=req.body, headers=req.headers) as resp:
                if meta is not None:
                    meta["headers"] = resp.headers
                if resp.status_code >= 400:
                    self._check(resp, await resp.aread())
                async for chunk in aparse_sse(resp.aiter_lines()):
                    finished = finished or chunk_finishes(chunk)
                    yield self._chunk(chunk, req)
        except httpx.TransportError as exc:
            raise await self._failed(exc, req.path) from exc
        if not finished:
            raise _incomplete(f"{self.base_url}{req.path}")

    async def _stream_result(self, path: str, body: Json) -> StreamResult:
        return stream_result(path, [chunk async for chunk in self.events(Request.stream(path, body))])

    async def request(self, method: str, path: str, body: Json | None = None) -> httpx.Response:
        """Send a request; raise on transport failure or an error status."""
        return await self.send(Request(method, path, body, _response))

    async def get_json(self, path: str) -> Any:
        """GET ``path`` and decode JSON."""
        return await self.send(Request.get(path))

    async def post_json(self, path: str, body: Json) -> Any:
        """POST ``body`` to ``path`` and decode JSON."""
        return await self.send(Request.post(path, body))

    def stream_events(
        self,
        path: str,
        body: Json,
        *,
        headers: Mapping[str, str] | None = None,
        meta: MutableMapping[str, Any] | None = None,
    ) -> AsyncIterator[Json]:
        """POST with ``stream: true`` and yield each SSE chunk (raises on an error event); use ``async for``.

        ``headers`` go with this request only; ``meta["headers"]`` receives the response headers.
        """
        return self.events(Request.stream(path, body, headers), meta)

    # -- endpoints
    async def health(self) -> Json:
        """``GET /health``."""
        return await self.send(HEALTH)

    async def props(self) -> Json:
        """``GET /props``."""
        return await self.send(PROPS)

    async def pool_features(self, *, refresh: bool = False) -> PoolFeatures:
        """What the server offers for pools (``/props``), read once per client unless ``refresh``."""
        if self._pool_features is None or refresh:
            self._pool_features = PoolFeatures.from_props(await self.props())
        return self._pool_features

    async def slots(self) -> list[Json]:
        """``GET /slots``."""
        return await self.send(SLOTS)

    async def metrics(self) -> dict[str, float]:
        """``GET /metrics`` parsed into a dict."""
        return await self.send(METRICS)

    async def tokenize(
        self, content: str, *, add_special: bool = False, parse_special: bool = True, with_pieces: bool = False
    ) -> list[Any]:
        """``POST /tokenize``."""
        req = tokenize_request(content, add_special=add_special, parse_special=parse_special, with_pieces=with_pieces)
        return await self.send(req)

    async def detokenize(self, tokens: list[int]) -> str:
        """``POST /detokenize``."""
        return await self.send(Request.post("/detokenize", {"tokens": tokens}, _field("content")))

    async def apply_template(self, messages: list[Json], **params: Any) -> str:
        """``POST /apply-template``."""
        return await self.send(Request.post("/apply-template", {"messages": messages, **params}, _field("prompt")))

    async def prompt_tokens(self, prompt: str) -> list[int]:
        """The tokens ``/completion`` will evaluate for ``prompt``."""
        return await self.send(prompt_tokens_request(prompt))

    async def shared_prefix_len(self, pool_prompt: str, prompt: str) -> int:
        """P for a sharer of ``pool_prompt`` (:func:`polykv_py.tokens.shared_prefix_len` of the tokenized prompts)."""
        return shared_prefix_len(await self.prompt_tokens(pool_prompt), await self.prompt_tokens(prompt))

    async def completion(self, prompt: Prompt, *, share: Share | None = None, **params: Any) -> Json:
        """``POST /completion`` (non-stream)."""
        return await self.post_json(COMPLETION, generation_body("prompt", prompt, share, params))

    async def completion_stream(self, prompt: Prompt, *, share: Share | None = None, **params: Any) -> StreamResult:
        """``POST /completion`` streamed."""
        return await self._stream_result(COMPLETION, generation_body("prompt", prompt, share, params))

    async def oai_completion(self, prompt: Prompt, *, share: Share | None = None, **params: Any) -> Json:
        """``POST /v1/completions`` (non-stream)."""
        return await self.post_json(OAI_COMPLETION, generation_body("prompt", prompt, share, params))

    async def oai_completion_stream(self, prompt: Prompt, *, share: Share | None = None, **params: Any) -> StreamResult:
        """``POST /v1/completions`` streamed."""
        return await self._stream_result(OAI_COMPLETION, generation_body("prompt", prompt, share, params))

    async def chat(self, messages: list[Json], *, share: Share | None = None, **params: Any) -> Json:
        """``POST /v1/chat/completions`` (non-stream)."""
        return await self.post_json(CHAT, generation_body("messages", messages, share, params))

    async def chat_stream(self, messages: list[Json], *, share: Share | None = None, **params: Any) -> StreamResult:
        """``POST /v1/chat/completions`` streamed."""
        return await self._stream_result(CHAT, generation_body("messages", messages, share, params))

    # -- the pool
    async def prime(self, prompt: Prompt, slot: int | None, **params: Any) -> Json:
        """Fill ``slot`` with ``prompt`` (processed and cached, nothing generated; None: any slot)."""
        return await self.send(prime_request(prompt, slot, params))

    async def share_for(self, pool_prompt: str, prompt: str, *, pool_slot: int = 0) -> Share:
        """The sharing fields for ``prompt`` over ``pool_slot`` (see :meth:`Client.share_for`)."""
        if (await self.pool_features()).server_prefix:
            return Share(pool_slot)
        return Share(pool_slot, await self.shared_prefix_len(pool_prompt, prompt))

    async def share(self, pool_prompt: str, prompt: str, *, pool_slot: int = 0, **params: Any) -> Json:
        """``POST /completion`` sharing the pool slot that holds ``pool_prompt`` (see :meth:`Client.share`)."""
        share = await self.share_for(pool_prompt, prompt, pool_slot=pool_slot)
        return await self.completion(prompt, share=share, **params)

    async def erase_slot(self, slot: int) -> Json:
        """Empty ``slot``'s KV (``POST /slots/{slot}?action=erase``)."""
        return await self.send(erase_request(slot))

    async def save_pool(
        self, slot: int, filename: str, *, cache_salt: str | None = None, sha256_of_tokens: str | None = None
    ) -> Json:
        """Save reserved pool ``slot`` to ``filename`` (see :meth:`Client.save_pool`)."""
        fields = {"cache_salt": cache_salt, "sha256_of_tokens": sha256_of_tokens}
        return await self.send(pool_file_request("save", slot, filename, **fields))

    async def restore_pool(self, slot: int, filename: str, **fields: Unpack[RestoreFields]) -> Json:
        """Restore reserved pool ``slot`` from ``filename`` (see :meth:`Client.restore_pool`)."""
        return await self.send(pool_file_request("restore", slot, filename, **fields))

    async def pools(self) -> list[PoolState]:
        """The reserved pools' states (see :meth:`Client.pools`)."""
        return pool_states(await self.slots())


def routed_replica(headers: Mapping[str, str] | None) -> str | None:
    """The replica a gateway sent a request to (smg's ``x-smg-routed-worker-id``), else None."""
    return None if headers is None else headers.get(ROUTED_WORKER_HEADER)

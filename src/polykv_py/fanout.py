"""N agents over one shared base context on a patched llama-server.

A :class:`Fanout` primes a pool slot with the templated base context, then
fans agent requests out concurrently.  Every agent request carries
``shared_pool_slot`` and ``shared_prefix_n_tokens`` = P, where P is the common
prefix of the *tokenized* pool prompt and the *tokenized* agent prompt (never
``len(tokenize(base))``: a token at the seam may tokenize differently, see
``docs/fanout.md``).  A server that computes P itself (its ``/props`` has a ``polykv``
object: :class:`~polykv_py.client.PoolFeatures`) gets only ``shared_pool_slot``.  The
server verifies the tokens and reports what it did in ``shared_prefix.status``.  A report
that the pool is gone (``not_resident``, ``mismatch``) re-primes the pool for the agents
that follow; the agent that saw it still has a correct answer (the server recomputed its
prefix). With a :class:`~polykv_py.pools.PoolCache` a priming first tries to restore the pool
from a saved file (named by the server's model and KV identity and the pool's tokens) and
saves one after computing it, so a base is computed once, across restarts.

Typical use::

    base = BasePrompt.chat(system="You review designs.", document=text)
    async with Fanout.connect("http://127.0.0.1:8080", base) as ctx:
        result = await ctx.run([Agent("List the risks."), Agent("Summarize.")])

or synchronously: ``run_fanout(base, agents, server=url_or_LlamaServer)``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from .client import (
    CHAT,
    COMPLETION,
    DEFAULT_TIMEOUT,
    AsyncClient,
    PoolFeatures,
    Share,
    aggregate,
    generation_body,
    routed_replica,
)
from .errors import HTTPError, PolykvError, ServerUnavailableError, first_line, server_gone, stale_connection
from .jsontypes import Json
from .pools import PoolCache, pool_file_name
from .results import ERROR, NOT_SHARED, AgentResult, FanoutResult, Mode, PrimeResult, needs_reprime
from .tokens import shared_prefix_len

log = logging.getLogger(__name__)


#: The endpoint each agent mode is sent to.
ENDPOINTS: dict[Mode, str] = {"completion": COMPLETION, "chat": CHAT}


class FanoutError(PolykvError):
    """A fan-out could not be set up (bad base context or agent, unusable server answer)."""


# --------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class BasePrompt:
    """The shared part of every agent's prompt: plain text, or chat messages.

    Completion agents see ``text + instructions``; chat agents see ``messages`` plus a
    user message with their instructions.
    """

    text: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise FanoutError("a base context is either text or chat messages, not both or neither")
        if self.text is not None and not self.text:
            raise FanoutError("the base context text is empty")
        if self.messages is not None and not self.messages:
            raise FanoutError("the base context has no messages")

    @classmethod
    def from_text(cls, text: str) -> BasePrompt:
        """A plain-text base (completion agents append their instructions to it)."""
        return cls(text=text)

    @classmethod
    def chat(cls, *, system: str | None = None, document: str | None = None) -> BasePrompt:
        """A chat base: one system message holding the system prompt and the shared document."""
        parts = [p for p in (system, document) if p]
        if not parts:
            raise FanoutError("a chat base needs a system prompt or a document")
        return cls(messages=({"role": "system", "content": "\n\n".join(parts)},))

    @classmethod
    def from_messages(cls, messages: Sequence[Mapping[str, Any]]) -> BasePrompt:
        """A chat base from explicit messages."""
        return cls(messages=tuple(dict(m) for m in messages))

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class Agent:
    """One agent: its own instructions, mode and request parameters.

    ``params`` go into the request body as they are (sampling: ``temperature``,
    ``seed``, ``top_p`` ...; length: ``n_predict`` for completion, ``max_tokens`` for
    chat). ``mode=None`` follows the base: chat for a chat base, completion for text.
    """

    instructions: str
    name: str = ""
    mode: Mode | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    def resolved_mode(self, base: BasePrompt) -> Mode:
        mode = self.mode or ("chat" if base.is_chat else "completion")
        if mode not in ("completion", "chat"):
            raise FanoutError(f"agent mode must be 'completion' or 'chat', not {mode!r}")
        return mode

    def messages(self, base: BasePrompt) -> list[Json]:
        """The chat messages of this agent."""
        if base.messages is not None:
            head = [dict(m) for m in base.messages]
        else:
            head = [{"role": "system", "content": base.text}]
        return [*head, {"role": "user", "content": self.instructions}]

    def prompt(self, base: BasePrompt) -> str:
        """The completion prompt of this agent (the base text followed by the instructions)."""
        if base.text is None:
            raise FanoutError("a completion agent needs a text base (use chat mode over chat messages)")
        return base.text + self.instructions


ProgressCallback = Callable[[str, Any], None]


# --------------------------------------------------------------------------- logic
def chunk_has_text(chunk: Json, mode: Mode | str) -> bool:
    """True for a stream chunk that carries generated text (for time-to-first-token).

    ``mode``: the agent mode, or the endpoint (``/completion`` is the native answer, the rest OpenAI's).
    """
    if mode in ("completion", COMPLETION):
        return bool(chunk.get("content")) or bool(chunk.get("tokens"))
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or choice.get("text"):
            return True
    return False


def answer_text(final: Json, mode: Mode | str) -> tuple[str, str | None]:
    """(text, finish reason) of a final answer (``mode`` as for :func:`chunk_has_text`)."""
    if mode in ("completion", COMPLETION):
        return str(final.get("content", "")), final.get("stop_type")
    choices = final.get("choices") or [{}]
    msg = choices[0].get("message") or {}
    return str(msg.get("content") or choices[0].get("text") or ""), choices[0].get("finish_reason")


def token_probs(final: Json) -> list[Json] | None:
    """The per-token probabilities of an answer (``n_probs``), native or OpenAI-shaped; None without them."""
    probs = final.get("completion_probabilities")
    if probs is None:
        lp = ((final.get("choices") or [{}])[0] or {}).get("logprobs")
        probs = lp.get("content") if isinstance(lp, dict) else None
    return list(probs) if isinstance(probs, list) and probs else None


def server_shared(sp: Json | None) -> int:
    """The prompt tokens the server took from the pool (``shared_prefix.shared``; 0 without it)."""
    return int(sp.get("shared") or 0) if isinstance(sp, dict) else 0


# --------------------------------------------------------------------------- the object
class Fanout:
    """A base context held once in a pool slot, and the agents fanned out over it.

    ``client`` is an :class:`~polykv_py.client.AsyncClient` (the caller keeps
    ownership unless it came from :meth:`connect`). ``share=False`` sends the same
    requests without the sharing fields (a baseline; ``prime`` then only warms the
    server's ordinary caches).  ``concurrency`` bounds the requests in flight
    (default: the server's slots minus the pool slot). With ``keep_going`` a failed
    agent request becomes a result with status ``"error"`` instead of failing the run.
    ``server_prefix``: leave P to the server (True), send it (False), or ask the server
    (None: :attr:`~polykv_py.client.PoolFeatures.server_prefix`); with the server's P an
    agent's ``requested`` is the server's count (``shared_prefix.shared``).
    A server that is gone (its process exited, or it refuses connections) fails the run
    whatever ``keep_going`` says: the :class:`~polykv_py.errors.ServerUnavailableError`
    (with the server's log tail when the client belongs to a ``LlamaServer``) is raised,
    the agents still in flight are cancelled, and the pool is forgotten, so the next
    :meth:`run` (after e.g. :meth:`LlamaServer.restart`) primes it again first.
    ``pool_cache``: restore the pool from its file there instead of computing it, and save it
    after computing it (a server with pool files, patch 0075, whose ``--slot-save-path`` is the
    cache's directory; a server without them is primed as usual, with a warning).
    ``cache_salt``: the pool's salt (llama.cpp's ``cache_salt``), sent on the prime, the pool
    file's save and restore (and hashed into its name), and every agent request (unless the
    agent's ``params`` name one): only requests with the same salt share the pool.
    """

    def __init__(
        self,
        client: AsyncClient,
        base: BasePrompt,
        *,
        pool_slot: int = 0,
        concurrency: int | None = None,
        share: bool = True,
        reprime: bool = True,
        pin_prime: bool = True,
        keep_going: bool = True,
        server_prefix: bool | None = None,
        pool_cache: PoolCache | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.client = client
        #: where the pool lives and tokens are counted: the same server, unless requests go through a
        #: gateway (:class:`~polykv_py.routing.RoutedFanout` points it at the pool's replica)
        self.pool_client = client
        self.base = base
        self.pool_slot = pool_slot
        self.share = share
        self.reprime = reprime
        self.pin_prime = pin_prime
        self.keep_going = keep_going
        self.concurrency = concurrency
        self.server_prefix = server_prefix
        self.pool_cache = pool_cache if share else None
        self.cache_salt = cache_salt or None
        self._features: PoolFeatures | None = None
        self._owns_client = False
        self._pool_prompt: str | None = None
        self._pool_tokens: list[int] | None = None
        self._generation = 0
        self._primed_generation = -1
        self._lost_reason: str | None = None
        self._ready = asyncio.Event()
        self._prime_lock = asyncio.Lock()
        self._tokens_cache: dict[str, list[int]] = {}
        self.primes: list[PrimeResult] = []
        self._progress: ProgressCallback | None = None

    # -- construction -------------------------------------------------------------
    @classmethod
    def connect(
        cls,
        url: str,
        base: BasePrompt,
        *,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = 64,
        server: Any = None,
        **kwargs: Any,
    ) -> Fanout:
        """A shared context on the server at ``url`` (owns its client: use ``async with``).

        ``timeout``: seconds a request may wait for the next bytes; ``max_connections``
        bounds the requests in flight at the HTTP level (keep it >= ``concurrency``).
        ``server``: the :class:`~polykv_py.llama_server.LlamaServer` behind ``url``, if any: a failed
        request then says whether the process exited, with its exit status and log tail.
        """
        client = AsyncClient(url, api_key=api_key, timeout=timeout, max_connections=max_connections, server=server)
        ctx = cls(client, base, **kwargs)
        ctx._owns_client = True
        return ctx

    async def aclose(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- tokens -------------------------------------------------------------------
    async def _retry(self, call: Callable[[], Any]) -> Any:
        """Run an idempotent request, once more if a stale kept-alive connection failed it."""
        try:
            return await call()
        except ServerUnavailableError as exc:
            if not stale_connection(exc):
                raise
            log.debug("retrying after a stale connection: %s", first_line(exc))
            return await call()

    async def _tokens(self, text: str) -> list[int]:
        toks = self._tokens_cache.get(text)
        if toks is None:
            toks = await self._retry(lambda: self.pool_client.prompt_tokens(text))
            self._tokens_cache[text] = toks
        return toks

    async def pool_prompt(self) -> str:
        """The text the pool slot holds: the base, templated when it is chat."""
        if self._pool_prompt is None:
            if self.base.messages is not None:
                msgs = [dict(m) for m in self.base.messages]
                self._pool_prompt = await self._retry(
                    lambda: self.pool_client.apply_template(msgs, add_generation_prompt=False)
                )
            else:
                assert self.base.text is not None
                self._pool_prompt = self.base.text
        return self._pool_prompt

    async def pool_tokens(self) -> list[int]:
        """Tokens of :meth:`pool_prompt`, exactly as the server evaluates them."""
        if self._pool_tokens is None:
            self._pool_tokens = await self._tokens(await self.pool_prompt())
            if not self._pool_tokens:
                raise FanoutError("the base context has no tokens")
        return self._pool_tokens

    async def agent_prompt(self, agent: Agent) -> str:
        """The full text the server evaluates for ``agent`` (templated for chat)."""
        if agent.resolved_mode(self.base) == "chat":
            msgs = agent.messages(self.base)
            return await self._retry(lambda: self.pool_client.apply_template(msgs))
        return agent.prompt(self.base)

    async def agent_tokens(self, agent: Agent) -> list[int]:
        return await self._tokens(await self.agent_prompt(agent))

    async def prefix_len(self, agent: Agent) -> int:
        """P for ``agent`` (see :func:`shared_prefix_len`)."""
        return shared_prefix_len(await self.pool_tokens(), await self.agent_tokens(agent))

    async def features(self) -> PoolFeatures:
        """What the server offers for pools (its ``/props``, read once)."""
        if self._features is None:
            self._features = await self._retry(self.pool_client.pool_features)
        return self._features

    async def uses_server_prefix(self) -> bool:
        """True when the agents' requests leave P to the server (see ``server_prefix``)."""
        if self.server_prefix is not None:
            return self.server_prefix
        return (await self.features()).server_prefix

    async def check_pool_slot(self) -> None:
        """Raise :class:`FanoutError` when the server reserves pools and ours is not one of them."""
        try:
            (await self.features()).check_pool_slot(self.pool_slot)
        except ValueError as exc:
            raise FanoutError(str(exc)) from None

    async def share_fields(self, agent: Agent) -> Share:
        """The sharing fields for ``agent``: the pool slot, and P unless the server computes it."""
        if await self.uses_server_prefix():
            return Share(self.pool_slot)
        return Share(self.pool_slot, await self.prefix_len(agent))

    async def extra_body(self, agent: Agent) -> Json:
        """The sharing fields for ``agent`` (and the pool's ``cache_salt``), e.g. for the OpenAI client's
        ``extra_body``."""
        return {**(await self.share_fields(agent)).fields(), **self._salt()}

    def _salt(self) -> Json:
        """The ``cache_salt`` field of every request for the pool (none when unsalted)."""
        return {"cache_salt": self.cache_salt} if self.cache_salt else {}

    # -- pool ---------------------------------------------------------------------
    async def prime(self, reason: str = "initial") -> PrimeResult:
        """Compute the base into the pool slot (pinned with ``id_slot``) and wait for it."""
        async with self._prime_lock:
            return await self._prime_locked(reason)

    async def _pool_file(self, tokens: list[int]) -> str | None:
        """The pool's cache file name, or None without a pool cache (or a server without pool files)."""
        if self.pool_cache is None:
            return None
        identity = (await self.features()).pool_files
        if identity is None:
            log.warning("the server has no pool files (patch 0075 with --pool-slots): priming without the pool cache")
            self.pool_cache = None
            return None
        return pool_file_name(identity, tokens, self.cache_salt)

    async def _restore(self, name: str, tokens: list[int], reason: str) -> PrimeResult | None:
        """Restore the pool from its cache file; None on a miss or a refused file (then it is primed and saved)."""
        assert self.pool_cache is not None
        t0 = time.perf_counter()
        try:
            answer = await self.pool_client.restore_pool(
                self.pool_slot, name, tokens=tokens, cache_salt=self.cache_salt
            )
        except HTTPError as exc:
            PoolCache.restore_failed(exc, name)
            return None
        wall = time.perf_counter() - t0
        self.pool_cache.restored(name)
        ms = (answer.get("timings") or {}).get("restore_ms")
        return PrimeResult(0, len(tokens), 0, wall, reason, restored_from=name, restore_ms=ms)

    async def _prime_locked(self, reason: str) -> PrimeResult:
        self._ready.clear()
        try:
            tokens = await self.pool_tokens()
            name = await self._pool_file(tokens)
            res = await self._restore(name, tokens, reason) if name else None
            if res is None:
                t0 = time.perf_counter()
                slot = self.pool_slot if self.pin_prime else None
                answer = await self.pool_client.prime(tokens, slot, **self._salt())
                wall = time.perf_counter() - t0
                timings = answer.get("timings") or {}
                n_computed = int(timings.get("prompt_n", len(tokens)))
                res = PrimeResult(0, len(tokens), n_computed, wall, reason, saved_to=await self._save(name))
            self._generation += 1
            res.generation = self._generation
            self.primes.append(res)
            self._primed_generation = self._generation
            log.info(
                "%s pool slot %d with %d tokens (%d computed) in %.2fs (%s)",
                f"restored from {res.restored_from}" if res.restored_from else "primed",
                self.pool_slot,
                res.n_tokens,
                res.processed,
                res.wall_s,
                reason,
            )
            if self._progress:
                self._progress("prime", res)
            return res
        finally:
            self._ready.set()

    async def _save(self, name: str | None) -> str | None:
        """Save the freshly primed pool as ``name`` (then trim the cache); None if not saved."""
        if name is None or self.pool_cache is None:
            return None
        try:
            await self.pool_client.save_pool(self.pool_slot, name, cache_salt=self.cache_salt)
        except HTTPError as exc:
            log.warning("could not save pool slot %d to %s: %s", self.pool_slot, name, exc.server_message)
            return None
        self.pool_cache.saved(name)
        return name

    async def ensure_primed(self) -> None:
        """Prime the pool unless it has been primed already (or was forgotten since)."""
        if self._primed_generation < 0:
            async with self._prime_lock:
                if self._primed_generation < 0:
                    await self._prime_locked(self._initial_reason())

    def forget_pool(self, reason: str = "server restart") -> None:
        """Mark the pool as not primed (e.g. the server was restarted and its KV is empty):
        the next :meth:`run` or :meth:`ask` primes it again before any agent is sent."""
        if self._primed_generation >= 0:
            log.info("pool slot %d forgotten (%s): the next run primes it again", self.pool_slot, reason)
            self._lost_reason = reason
        self._primed_generation = -1

    def _initial_reason(self) -> str:
        return "initial" if self._lost_reason is None else f"re-prime after {self._lost_reason}"

    async def _reprime_after(self, generation: int, status: str) -> None:
        async with self._prime_lock:
            if self._primed_generation != generation:
                return  # someone re-primed already
            log.warning("pool slot %d reported %s: re-priming", self.pool_slot, status)
            await self._prime_locked(f"re-prime after {status}")

    async def slot_count(self) -> int:
        props = await self._retry(self.pool_client.props)
        return int(props.get("total_slots") or 1)

    # -- agents -------------------------------------------------------------------
    def _failed(self, agent: Agent, index: int, t_origin: float, n_prompt: int, exc: Exception) -> AgentResult:
        now = time.perf_counter() - t_origin
        return AgentResult(
            index=index,
            name=agent.name or f"agent-{index + 1}",
            mode=agent.resolved_mode(self.base),
            text="",
            status=ERROR,
            requested=0,
            shared=0,
            n_prompt=n_prompt,
            processed=0,
            cached=0,
            n_generated=0,
            ttft_s=None,
            latency_s=0.0,
            started_s=now,
            finished_s=now,
            finish_reason=None,
            id_slot=None,
            error=first_line(exc),
        )

    @staticmethod
    def _sent_p(share: Share | None) -> int:
        return share.n_tokens or 0 if share is not None else 0

    def _endpoint(self, mode: Mode) -> str:
        """Where an agent of ``mode`` is sent."""
        return ENDPOINTS[mode]

    def _stream(self, path: str, body: Json, meta: dict[str, Any]) -> AsyncIterator[Json]:
        """The answer stream of one agent request (``meta["headers"]``: the response headers)."""
        return self.client.stream_events(path, body, meta=meta)

    def _body(self, agent: Agent, mode: Mode, share: Share | None) -> Json:
        params = {**self._salt(), **agent.params}
        if mode == "chat":
            return generation_body("messages", agent.messages(self.base), share, params)
        return generation_body("prompt", agent.prompt(self.base), share, params)

    async def ask(self, agent: Agent, *, index: int = 0, t_origin: float | None = None) -> AgentResult:
        """Send one agent (streamed, to time its first token) and return its result."""
        mode = agent.resolved_mode(self.base)
        n_prompt_tokens = await self.agent_tokens(agent)
        share = await self.share_fields(agent) if self.share else None
        server_p = share is not None and share.n_tokens is None
        if self.share:
            await self.check_pool_slot()
            await self.ensure_primed()
            await self._ready.wait()
        generation = self._primed_generation
        path = self._endpoint(mode)
        origin = t_origin if t_origin is not None else time.perf_counter()
        t0 = time.perf_counter()
        ttft: float | None = None
        chunks: list[Json] = []
        body = self._body(agent, mode, share)
        meta: dict[str, Any] = {}
        for attempt in (1, 2):
            try:
                async for chunk in self._stream(path, body, meta):
                    if ttft is None and chunk_has_text(chunk, path):
                        ttft = time.perf_counter() - t0
                    chunks.append(chunk)
                break
            except ServerUnavailableError as exc:
                if chunks or attempt == 2 or not stale_connection(exc):
                    raise
                log.debug("agent %s: resending after a stale connection", agent.name or index)
        t1 = time.perf_counter()
        final = aggregate(path, chunks)
        text, finish = answer_text(final, path)
        timings = final.get("timings") or {}
        sp = final.get("shared_prefix")
        status = str(sp.get("status")) if isinstance(sp, dict) else NOT_SHARED
        if self.share and not isinstance(sp, dict):
            raise FanoutError("the server ignored shared_pool_slot: is it the patched llama-server?")
        res = AgentResult(
            index=index,
            name=agent.name or f"agent-{index + 1}",
            mode=mode,
            text=text,
            status=status,
            requested=server_shared(sp) if server_p else self._sent_p(share),
            shared=server_shared(sp),
            n_prompt=len(n_prompt_tokens),
            processed=int(timings.get("prompt_n", 0)),
            cached=int(timings.get("cache_n", 0)),
            n_generated=int(timings.get("predicted_n", 0)),
            ttft_s=ttft,
            latency_s=t1 - t0,
            started_s=t0 - origin,
            finished_s=t1 - origin,
            finish_reason=finish,
            id_slot=final.get("id_slot") if isinstance(final.get("id_slot"), int) else None,
            timings=dict(timings),
            shared_prefix=dict(sp) if isinstance(sp, dict) else None,
            replica=routed_replica(meta.get("headers")),
            probs=token_probs(final),
        )
        if self.share and self.reprime and needs_reprime(status, server_prefix=server_p):
            await self._reprime_after(generation, status)
        return res

    async def run(
        self,
        agents: Sequence[Agent],
        *,
        prime: bool | None = None,
        progress: ProgressCallback | None = None,
    ) -> FanoutResult:
        """Prime the pool (when sharing and not primed yet, or ``prime=True``) and run every agent.

        Results come back in the order of ``agents``. ``progress(event, payload)`` is
        called with ``("prime", PrimeResult)``, ``("start", index)`` and ``("done", AgentResult)``.
        """
        if not agents:
            raise FanoutError("no agents to run")
        modes = {a.resolved_mode(self.base) for a in agents}
        if "completion" in modes and self.base.text is None:
            raise FanoutError("completion agents need a text base")
        t0 = time.perf_counter()
        n_primes = len(self.primes)
        self._progress = progress
        try:
            return await self._run(agents, t0, n_primes, prime, progress)
        except ServerUnavailableError as exc:
            if server_gone(exc):
                self.forget_pool("server gone")
            raise
        finally:
            self._progress = None

    async def _run(
        self, agents: Sequence[Agent], t0: float, n_primes: int, prime: bool | None, progress: ProgressCallback | None
    ) -> FanoutResult:
        if self.share:
            await self.check_pool_slot()
        do_prime = prime if prime is not None else (self.share and self._primed_generation < 0)
        if do_prime:
            await self.prime(self._initial_reason() if self._primed_generation < 0 else "requested")
        n_pool = len(await self.pool_tokens())
        reserved = max(1, len((await self.features()).pool_slots)) if self.share else 0  # slots agents never get
        limit = self.concurrency or max(1, (await self.slot_count()) - reserved)
        sem = asyncio.Semaphore(limit)
        await asyncio.gather(*(self.agent_tokens(a) for a in agents))  # tokenize up front, concurrently

        ending: list[BaseException] = []  # set by the failure that ends the run

        async def one(i: int, agent: Agent) -> AgentResult:
            async with sem:
                if ending:  # the run is failing: send nothing more
                    raise asyncio.CancelledError
                if progress:
                    progress("start", i)
                try:
                    res = await self.ask(agent, index=i, t_origin=t0)
                except FanoutError:
                    raise
                except PolykvError as exc:
                    if server_gone(exc) or not self.keep_going:
                        ending.append(exc)
                        raise
                    log.error("agent %d (%s) failed: %s", i + 1, agent.name or "-", first_line(exc))
                    res = self._failed(agent, i, t0, len(await self.agent_tokens(agent)), exc)
            if progress:
                progress("done", res)
            return res

        tasks = [asyncio.ensure_future(one(i, a)) for i, a in enumerate(agents)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # the first failure ends the run: cancel the rest and wait for them
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return FanoutResult(
            agents=list(results),
            primes=list(self.primes[n_primes:]),
            pool_slot=self.pool_slot if self.share else None,
            pool_tokens=n_pool,
            wall_s=time.perf_counter() - t0,
            shared=self.share,
        )


# --------------------------------------------------------------------------- sync helper
#: The names of 0.1.0 (a fan-out is not a context: :class:`polykv_py.llama.Context` is one), kept for one release.
BaseContext = BasePrompt
SharedContext = Fanout


def run_fanout(
    base: BasePrompt,
    agents: Sequence[Agent],
    *,
    server: Any,
    api_key: str | None = None,
    **kwargs: Any,
) -> FanoutResult:
    """Run a fan-out synchronously. ``server`` is a URL or a running :class:`~polykv_py.llama_server.LlamaServer`.

    ``kwargs`` go to :class:`Fanout` (``pool_slot``, ``concurrency``, ``share`` ...).
    """
    url = server if isinstance(server, str) else server.url
    key = api_key if api_key is not None or isinstance(server, str) else getattr(server, "api_key", None)
    process = None if isinstance(server, str) else server  # errors then carry its exit status and log tail

    async def main() -> FanoutResult:
        async with Fanout.connect(url, base, api_key=key, server=process, **kwargs) as ctx:
            return await ctx.run(agents)

    return asyncio.run(main())

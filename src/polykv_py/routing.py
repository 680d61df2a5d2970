"""Pool affinity through a gateway: a pool's requests all reach the replica that holds the pool.

Replicas behind a gateway (smg, :mod:`polykv_py.gateway`) each hold their own KV. A request
that lands on a replica without its pool pays the whole base again, so every request for a
pool carries a *routing key* derived from the pool's identity (:func:`routing_key`: model id,
base, salt), and the gateway's ``manual`` policy pins each key to one replica.

:class:`Router` is the client side of one gateway: it sends the agents' requests through the
gateway (OpenAI routes: ``/v1/completions``, ``/v1/chat/completions``), asks the gateway where a
key lives (a one-token request, :meth:`Router.locate`), and talks to that replica directly for
what a gateway does not proxy (``/tokenize``, ``/props``, ``/slots``, priming pinned to a pool
slot, pool files). It also picks the pool slot on a replica (:meth:`Router.claim`): the one
that already holds the pool's tokens, else an empty one, else the least recently used that no
other pool of this process holds.

:class:`RoutedFanout` is a :class:`~polykv_py.fanout.Fanout` whose agents go through the
gateway. When an answer comes from another replica than the pool's (the gateway moved the key:
a replica failed or came back), the answer stands (the server recomputed the prefix, it is
correct) and the pool is placed on the new replica (restored from the pool cache or primed) for
the requests that follow. A request that *fails* on a replica (HTTP 5xx from the gateway, or a
stream cut short) raises :class:`ReplicaError` naming the replica; with ``retry`` (default) the
pool first moves to the replica the gateway now routes the key to, and the request is sent
once more. The server checks a pool's tokens on every share, so an agent can never get
another pool's KV, whichever replica it lands on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .client import CHAT, DEFAULT_TIMEOUT, OAI_COMPLETION, AsyncClient, Request, Share, routed_replica
from .errors import HTTPError, PolykvError, ServerUnavailableError, first_line, server_gone
from .fanout import Agent, BasePrompt, Fanout, FanoutError, ProgressCallback
from .gateway import MAX_ROUTING_KEY_BYTES, ROUTING_KEY_HEADER, worker_list
from .jsontypes import Json
from .pools import pool_states
from .results import AgentResult, FanoutResult, Mode, PrimeResult, needs_reprime

log = logging.getLogger(__name__)


#: The model id every replica reports (``llama-server --alias``); requests must name it.
DEFAULT_MODEL = "polykv"
#: Seconds :meth:`Router.locate` waits for the gateway to route a key away from a failed replica.
DEFAULT_MOVE_TIMEOUT = 30.0
_URL_IN_MESSAGE = re.compile(r"URL: (https?://[^/\s]+)")


def routing_key(model: str, base: BasePrompt, cache_salt: str | None = None) -> str:
    """The gateway routing key of a pool: ``pool-`` and 48 hex digits of a sha256.

    It covers the model id the replicas serve, the base exactly as the client holds it (text, or
    the chat messages before templating) and the salt's hash. For one model the base determines
    the pool's tokens, so equal keys mean equal pools; the key is computed from what any client
    has, without a tokenizer (a gateway does not proxy ``/tokenize``). A plain OpenAI client can
    send the same key in the ``X-SMG-Routing-Key`` header.
    """
    salt_hash = hashlib.sha256(cache_salt.encode()).hexdigest() if cache_salt else None
    doc = {
        "polykv_pool": 1,
        "model": model,
        "text": base.text,
        "messages": [dict(m) for m in base.messages] if base.messages is not None else None,
        "salt_sha256": salt_hash,  # the field name keeps keys stable across versions
    }
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())
    key = f"pool-{digest.hexdigest()[:48]}"
    assert len(key) <= MAX_ROUTING_KEY_BYTES
    return key


class ReplicaError(PolykvError):
    """A request failed on a replica behind the gateway (the replica died, or its stream was cut)."""

    def __init__(self, message: str, *, replica: str | None) -> None:
        super().__init__(message)
        self.replica = replica


def failed_replica(exc: BaseException, headers: Mapping[str, str] | None = None) -> str | None:
    """The replica a failed request was on: the gateway's routed-worker header, else the URL in its message."""
    replica = routed_replica(headers)
    if replica:
        return replica
    m = _URL_IN_MESSAGE.search(str(exc))
    return m.group(1) if m else None


def is_replica_failure(exc: BaseException) -> bool:
    """True for a failure of the replica behind the gateway, not of the request: the gateway could not
    reach it (HTTP 502-504, or a 500 naming the replica's URL) or its stream broke off ("Stream error", or
    a stream that ended early). A replica's own answer (e.g. 500 "Context size has been exceeded") is not."""
    if isinstance(exc, HTTPError):
        msg = exc.server_message
        return exc.status in (502, 503, 504) or "Stream error" in msg or bool(_URL_IN_MESSAGE.search(msg))
    return isinstance(exc, ServerUnavailableError) and not server_gone(exc)


@dataclass(frozen=True)
class Move:
    """The pool of a routed context placed on a replica."""

    key: str
    from_replica: str | None
    to_replica: str
    pool_slot: int
    reason: str


class Router:
    """The client side of one gateway: its OpenAI routes, the replicas behind it, and the pool slots
    this process placed pools in.

    ``model``: the id every replica serves (``--alias``). ``timeout``, ``max_connections``: as for
    :class:`~polykv_py.client.AsyncClient`, for the gateway and each replica. Close with
    :meth:`aclose` (or ``async with``).
    """

    def __init__(
        self,
        gateway_url: str,
        *,
        model: str = DEFAULT_MODEL,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = 64,
        move_timeout: float = DEFAULT_MOVE_TIMEOUT,
    ) -> None:
        self.url = gateway_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.max_connections = max_connections
        self.move_timeout = move_timeout
        self.client = AsyncClient(self.url, api_key=api_key, timeout=timeout, max_connections=max_connections)
        self._replicas: dict[str, AsyncClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._claims: dict[tuple[str, int], str] = {}  # (replica, pool slot) -> routing key

    async def aclose(self) -> None:
        await self.client.aclose()
        for c in self._replicas.values():
            await c.aclose()
        self._replicas.clear()

    async def __aenter__(self) -> Router:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def replica(self, url: str) -> AsyncClient:
        """A client for the replica at ``url`` (made once)."""
        url = url.rstrip("/")
        if url not in self._replicas:
            self._replicas[url] = AsyncClient(
                url, api_key=self.api_key, timeout=self.timeout, max_connections=self.max_connections
            )
        return self._replicas[url]

    def context(self, base: BasePrompt, **kwargs: Any) -> RoutedFanout:
        """A :class:`RoutedFanout` for ``base`` through this gateway (``kwargs`` as for it)."""
        return RoutedFanout(self, base, **kwargs)

    async def locate(self, key: str, *, avoid: str | None = None) -> str:
        """The replica the gateway routes ``key`` to now (one generated token on it).

        ``avoid``: a replica that just failed. First wait (at most ``move_timeout`` s) until the gateway
        no longer reports it healthy (``GET /workers``: its probes or circuit breaker took it out of
        rotation), so the key is not routed back to it a moment later, then ask where the key goes.
        """
        body = {"model": self.model, "prompt": "\n", "max_tokens": 1, "n_predict": 1, "temperature": 0.0}
        req = Request("POST", OAI_COMPLETION, body, parse=lambda r: r.headers, headers={ROUTING_KEY_HEADER: key})
        deadline = time.monotonic() + self.move_timeout
        if avoid is not None:
            await self._wait_out_of_rotation(avoid, deadline)
        last = "no answer"
        while True:
            try:
                headers = await self.client.send(req)
                replica = routed_replica(headers)
                if replica is None:
                    raise FanoutError(f"{self.url} named no replica ({ROUTING_KEY_HEADER} routing needs smg >= 1.10)")
                if replica != avoid:
                    return replica
                last = f"still routed to {avoid}"
            except HTTPError as exc:
                if not is_replica_failure(exc):
                    raise FanoutError(f"the gateway at {self.url} refused a request: {exc}") from exc
                last = first_line(exc)
            if time.monotonic() >= deadline:
                raise FanoutError(f"the gateway at {self.url} routes {key[:16]}... to no live replica: {last}")
            await asyncio.sleep(0.25)

    async def _wait_out_of_rotation(self, replica: str, deadline: float) -> None:
        """Wait until the gateway's worker list shows ``replica`` unhealthy or gone (or the deadline)."""
        while time.monotonic() < deadline:
            try:
                doc = await self.client.get_json("/workers")
            except PolykvError:
                return  # not smg's worker API: rely on the probes alone
            if not any(w.get("url") == replica and w.get("is_healthy") for w in worker_list(doc)):
                return
            await asyncio.sleep(0.2)

    async def claim(self, replica: str, key: str, tokens: list[int], cache_salt: str | None = None) -> tuple[int, bool]:
        """A pool slot on ``replica`` for the pool ``key`` with ``tokens``: (slot, already resident).

        Prefers the slot that already holds these tokens (another client may have primed it), then
        an empty one, then the least recently used one without sharers; never a slot this process
        placed another pool in. A pool holds the tokens when :meth:`~polykv_py.pools.PoolState.holds` says
        so: same tokens and same salt (a salted pool shows only a MAC of its tokens keyed with its salt).
        Raises :class:`FanoutError` when there is none.
        """
        lock = self._locks.setdefault(replica, asyncio.Lock())
        async with lock:
            states = pool_states(await self.replica(replica).slots())
            if not states:
                raise FanoutError(f"replica {replica} has no reserved pool slots (start it with --pool-slots)")
            for (r, s), k in list(self._claims.items()):
                if k == key:
                    del self._claims[(r, s)]
            taken = {s for (r, s) in self._claims if r == replica}
            free = [s for s in states if s.slot not in taken]
            ours = [s for s in free if s.holds(tokens, cache_salt)]
            if ours:
                pick, resident = ours[0], True
            elif not free:
                raise FanoutError(
                    f"replica {replica}: all {len(states)} pool slots hold other pools of this process; "
                    "start the replicas with more --pool-slots"
                )
            else:
                empty = [s for s in free if s.empty]
                pick = empty[0] if empty else max(free, key=lambda s: (s.sharers == 0, s.last_use_s_ago or 0.0))
                resident = False
            self._claims[(replica, pick.slot)] = key
            return pick.slot, resident

    def release(self, key: str) -> None:
        """Forget the pool slots placed for ``key``."""
        for claim, k in list(self._claims.items()):
            if k == key:
                del self._claims[claim]


class RoutedFanout(Fanout):
    """A :class:`~polykv_py.fanout.Fanout` whose agents go through a gateway, with pool affinity.

    Every agent request carries the pool's routing key (:attr:`key`) and goes to the gateway's
    OpenAI routes (completion agents to ``/v1/completions``). The pool lives on :attr:`home`, the
    replica the gateway routes the key to, in the pool slot :meth:`Router.claim` picked; a move
    (the gateway routed an answer elsewhere, or a replica failed) places it again and is
    recorded in :attr:`moves`. ``retry``: send a request that failed on a replica again after
    the move (more than once only while the gateway still routes the key to a failed replica, for at
    most the router's ``move_timeout``). ``cache_salt`` goes into the key and, as for ``Fanout``, into
    the prime, the pool file's name, its save and restore, and every agent request. Other options as for
    ``Fanout`` (``pool_slot`` is chosen per replica and ignored).
    """

    def __init__(
        self,
        router: Router,
        base: BasePrompt,
        *,
        retry: bool = True,
        cache_salt: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("pool_slot", None)
        super().__init__(router.client, base, cache_salt=cache_salt, **kwargs)
        self.router = router
        self.key = routing_key(router.model, base, cache_salt)
        self.retry = retry
        self.home: str | None = None
        self.moves: list[Move] = []
        self._headers = {ROUTING_KEY_HEADER: self.key}
        self._place_lock = asyncio.Lock()

    # -- how agents are sent ------------------------------------------------------
    def _endpoint(self, mode: Mode) -> str:
        return CHAT if mode == "chat" else OAI_COMPLETION

    def _body(self, agent: Agent, mode: Mode, share: Share | None) -> Json:
        return {"model": self.router.model, **super()._body(agent, mode, share)}

    async def _stream(self, path: str, body: Json, meta: dict[str, Any]) -> AsyncIterator[Json]:
        try:
            async for chunk in self.client.stream_events(path, body, headers=self._headers, meta=meta):
                yield chunk
        except PolykvError as exc:
            if not is_replica_failure(exc):
                raise
            replica = failed_replica(exc, meta.get("headers"))
            raise ReplicaError(f"replica {replica or '(unknown)'} failed: {first_line(exc)}", replica=replica) from exc

    # -- where the pool lives -----------------------------------------------------
    async def _place(self, replica: str, reason: str) -> None:
        """Put the pool on ``replica``: claim a pool slot, then restore or prime it there unless it holds it."""
        old = self.home
        self.pool_client = self.router.replica(replica)
        self._features = None
        tokens = await self.pool_tokens()
        slot, resident = await self.router.claim(replica, self.key, tokens, self.cache_salt)
        self.pool_slot, self.home = slot, replica
        self.forget_pool(reason)
        if resident:
            async with self._prime_lock:
                self._generation += 1
                self._primed_generation = self._generation
                self.primes.append(PrimeResult(self._generation, len(tokens), 0, 0.0, f"{reason}: already resident"))
                self._ready.set()
        else:
            await self.prime(reason if old is None else f"moved: {reason}")
        self.moves.append(Move(self.key, old, replica, slot, reason))
        log.info("pool %s on %s slot %d (%s)", self.key[:16], replica, slot, reason)

    async def ensure_home(self) -> str:
        """The pool's replica, placing the pool there first if it has none yet."""
        if self.home is None:
            async with self._place_lock:
                if self.home is None:
                    await self._place(await self.router.locate(self.key), "initial")
        assert self.home is not None
        return self.home

    async def move(self, *, to: str | None = None, away_from: str | None = None, reason: str) -> None:
        """Place the pool on ``to``, or wherever the gateway routes the key once it avoids ``away_from``
        (nothing happens when another request moved it already)."""
        async with self._place_lock:
            if (to is not None and self.home == to) or (away_from is not None and self.home != away_from):
                return
            target = to or await self.router.locate(self.key, avoid=away_from)
            await self._place(target, reason)

    async def _reprime_after(self, generation: int, status: str) -> None:
        """Re-priming waits for :meth:`ask`, which knows whether the key moved."""

    # -- agents -------------------------------------------------------------------
    async def ask(self, agent: Agent, *, index: int = 0, t_origin: float | None = None) -> AgentResult:
        """Send one agent through the gateway; follow the pool when the gateway moves the key."""
        deadline = time.monotonic() + self.router.move_timeout
        while True:
            home = await self.ensure_home()
            generation = self._primed_generation
            try:
                res = await super().ask(agent, index=index, t_origin=t_origin)
            except ReplicaError as exc:
                who = agent.name or f"agent-{index + 1}"
                if not self.retry or time.monotonic() >= deadline:
                    raise ReplicaError(f"{who}: {exc}", replica=exc.replica) from exc
                log.warning("%s: %s: moving pool %s and sending it again", who, exc, self.key[:16])
                await self.move(away_from=exc.replica or home, reason=f"replica {exc.replica} failed")
                continue
            if res.replica is not None and res.replica != home:
                await self.move(to=res.replica, reason=f"the gateway routed the key to {res.replica}")
            elif (
                self.share and self.reprime and needs_reprime(res.status, server_prefix=await self.uses_server_prefix())
            ):
                await Fanout._reprime_after(self, generation, res.status)
            return res

    async def _run(
        self, agents: Sequence[Agent], t0: float, n_primes: int, prime: bool | None, progress: ProgressCallback | None
    ) -> FanoutResult:
        await self.ensure_home()  # the pool gets a replica (and is primed there) as part of the run
        return await super()._run(agents, t0, n_primes, prime, progress)

    async def aclose(self) -> None:
        self.router.release(self.key)
        await super().aclose()


#: The name of 0.1.0, kept for one release.
RoutedContext = RoutedFanout

"""K patched llama-server replicas and the gateway in front of them, on this machine.

For development, tests and the routing benchmark: ``polykv cluster`` runs one. Across machines
the same layout is ``polykv serve`` on each host and ``smg launch`` in front (``docs/cluster.md``).

Every replica is the patched server as ``polykv serve`` starts it (:func:`~polykv_py.presets.serve_server`):
unified KV, idle slots resident, ``pools_per_replica`` reserved pool slots plus ``agent_slots``,
``--alias`` = the model id clients name, and ``--slot-save-path`` = one pool cache directory for
all replicas, so a pool saved on one replica restores on another after a move. What must match
across replicas: the model file, the build (its pool-file identity), and the pool options.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from .errors import PolykvError, ServerError
from .gateway import Gateway, GatewayOptions
from .llama_server import LlamaServer
from .pools import PoolCache, pool_states
from .routing import DEFAULT_MODEL, Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    """The replicas' shape; the gateway's routing is :class:`~polykv_py.gateway.GatewayOptions`."""

    replicas: int = 3
    pools_per_replica: int = 3
    agent_slots: int = 4
    ctx: int = 8192
    threads: int = 1
    model: str | None = None
    alias: str = DEFAULT_MODEL
    pool_auto: bool = True
    shared_decode: bool = True
    share_any: bool = True
    track_kv: bool = False
    extra_args: tuple[str, ...] = ()
    gateway: GatewayOptions = field(default_factory=GatewayOptions)


class Cluster:
    """The replicas and the gateway (a context manager; :meth:`start` / :meth:`stop`).

    ``pool_cache``: the directory every replica saves pools to and restores them from (default: a
    fresh temporary directory). ``gateway_port``: the gateway's port (default: a free one).
    """

    def __init__(
        self,
        config: ClusterConfig | None = None,
        *,
        pool_cache: PoolCache | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        gateway_port: int | None = None,
    ) -> None:
        from .models import is_default_model, resolve_model
        from .presets import serve_server, template_args

        self.config = cfg = config or ClusterConfig()
        if cfg.replicas < 1 or cfg.pools_per_replica < 1:
            raise ValueError("a cluster needs at least one replica with at least one pool slot")
        self.pool_cache = pool_cache if pool_cache is not None else PoolCache(None)
        save_path = self.pool_cache.save_path
        default_model = is_default_model(resolve_model(cfg.model))  # gets polykv's tools template, as in polykv serve
        self.replicas: list[LlamaServer] = [
            serve_server(
                cfg.pools_per_replica,
                agent_slots=cfg.agent_slots,
                ctx=cfg.ctx,
                pool_auto=cfg.pool_auto,
                slot_actions=True,
                slot_save_path=save_path,
                shared_decode=cfg.shared_decode,
                share_any=cfg.share_any,
                extra_args=["--alias", cfg.alias, *template_args(default_model, cfg.extra_args), *cfg.extra_args],
                threads=cfg.threads,
                model=cfg.model,
                name=f"replica{i}",
                log_dir=log_dir,
                track_kv=cfg.track_kv,
            )
            for i in range(cfg.replicas)
        ]
        self._log_dir = log_dir
        self._gateway_port = gateway_port
        self.gateway: Gateway | None = None

    @property
    def url(self) -> str:
        """The gateway's URL: what clients use."""
        if self.gateway is None:
            raise ServerError("the cluster has not been started")
        return self.gateway.url

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start(self) -> Cluster:
        """Start every replica, then the gateway (ready once every replica is healthy behind it)."""
        try:
            for r in self.replicas:
                r.start()
            self.gateway = Gateway(
                self.replica_urls, self.config.gateway, port=self._gateway_port, log_dir=self._log_dir
            ).start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the gateway and every replica."""
        if self.gateway is not None:
            self.gateway.stop()
        for r in self.replicas:
            r.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def router(self, **kwargs: Any) -> Router:
        """A :class:`~polykv_py.routing.Router` for this cluster's gateway (caller closes it)."""
        return Router(self.url, model=self.config.alias, **kwargs)

    # ------------------------------------------------------------------ failures
    def kill(self, index: int) -> str:
        """SIGKILL replica ``index`` (a crash, not a shutdown); its URL."""
        r = self.replicas[index]
        os.kill(r.pid, signal.SIGKILL)
        r.wait(10)
        log.warning("replica %d (%s) killed", index, r.url)
        return r.url

    def restart(self, index: int, timeout: float = 60.0) -> str:
        """Start replica ``index`` again on its port and wait until the gateway routes to it again
        (re-registered if the gateway had marked it failed)."""
        r = self.replicas[index]
        url = r.url
        r.restart()
        if r.url != url:
            raise ServerError(f"replica {index} came back on another port ({r.url}): the gateway knows {url}")
        assert self.gateway is not None
        try:
            self.gateway.wait_workers(10.0, [url])
        except ServerError:
            log.info("the gateway does not route to %s yet: re-registering it", url)
            self.gateway.reregister(url, timeout)
        return url

    # ------------------------------------------------------------------ readings
    def status(self) -> list[dict[str, Any]]:
        """Per replica: URL, alive, the pools it holds (``/slots``) and its request counters (``/metrics``)."""
        out = []
        for i, r in enumerate(self.replicas):
            entry: dict[str, Any] = {"replica": i, "url": r.url if r.is_alive() else None, "alive": r.is_alive()}
            if r.is_alive():
                with contextlib.suppress(PolykvError):
                    entry["pools"] = [
                        {"slot": p.slot, "n_tokens": p.n_tokens, "hits": p.hits, "tokens_sha256": p.tokens_sha256}
                        for p in pool_states(r.client.slots())
                        if p.n_tokens
                    ]
                    m = r.client.metrics()
                    entry["prompt_tokens"] = int(m.get("llamacpp:prompt_tokens_total", 0))
                    entry["shares"] = int(m.get("llamacpp:polykv_share_requests_total", 0))
                    entry["share_hits"] = int(m.get("llamacpp:polykv_share_hits_total", 0))
            out.append(entry)
        return out

"""Start, watch and stop the gateway in front of llama-server replicas: smg (Shepherd Model Gateway).

polykv does not route requests itself. ``pip install "polykv[cluster]"`` brings ``smg``, a
maintained Rust gateway shipped as a wheel, which fronts llama-server replicas over their
OpenAI-compatible routes (``/v1/completions``, ``/v1/chat/completions``; llama.cpp's native
``/completion``, ``/slots``, ``/tokenize`` are not proxied). Its ``manual`` policy pins every
value of the ``X-SMG-Routing-Key`` header to one replica (``--assignment-mode`` picks the replica
for a new key; ``min_group``: the one with the fewest keys), which is what pool affinity needs:
:func:`polykv_py.routing.routing_key` derives the key from a pool's identity.

:class:`Gateway` runs ``smg launch`` on free loopback ports (API and Prometheus), logs to a file
of its own, is ready when every replica is registered and healthy (``GET /workers``), and stops
with SIGTERM then SIGKILL, like :class:`~polykv_py.llama_server.LlamaServer`. What smg does that a
client must know (measured with smg 1.13.0, see ``docs/cluster.md``):

- the response header ``x-smg-routed-worker-id`` names the replica (its URL) that answered;
- a replica that fails while a request is on it gives HTTP 5xx with the replica's URL in the
  message (or a stream cut short); a key moves to another replica only once the gateway stops
  routing to the failed one (health probes, circuit breaker), and moves back when it is healthy;
- a replica that stays down for ``3 x --health-failure-threshold`` probes is *failed* for good:
  :meth:`Gateway.reregister` (``PUT /workers/{id}``) brings it back once it answers again.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import httpx

from .client import parse_metrics
from .errors import ServerError
from .llama_server import (
    LoggedChild,
    _finalize,
    _terminate_group,
    default_log_dir,
    free_port,
    read_log_tail,
    spawn_logged,
)

log = logging.getLogger(__name__)

#: The header smg's ``manual`` policy pins to one replica.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
#: smg refuses longer routing keys.
MAX_ROUTING_KEY_BYTES = 128

Policy = Literal["manual", "round_robin", "cache_aware", "random", "least_load", "power_of_two", "prefix_hash"]
Assignment = Literal["random", "min_load", "min_group"]


def smg_command() -> list[str]:
    """How to run smg: the ``smg`` script next to this Python, on PATH, else ``python -m smg``."""
    here = Path(sys.executable).parent / "smg"
    if here.exists():
        return [str(here)]
    found = shutil.which("smg")
    if found:
        return [found]
    if importlib.util.find_spec("smg") is None:
        raise ServerError('the gateway is not installed: pip install "polykv[cluster]" (it brings smg)')
    return [sys.executable, "-m", "smg"]


@dataclass(frozen=True)
class GatewayOptions:
    """How the gateway routes and how fast it notices a failed replica.

    The defaults suit replicas on one machine or one rack: a probe a second, a replica out of
    rotation after 2 failed probes or 2 failed requests (circuit breaker), back after one good
    probe, and one resend at most (a request is replayed only on another replica's pool when the
    client asks, :class:`~polykv_py.routing.RoutedFanout`).
    """

    policy: Policy = "manual"
    assignment_mode: Assignment = "min_group"
    health_interval_s: int = 1
    health_timeout_s: int = 2
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    cb_failure_threshold: int = 2
    cb_timeout_s: int = 3
    retries: int = 1  # total attempts, the first included
    request_timeout_s: int = 1800
    log_level: str = "info"

    def args(self) -> list[str]:
        """smg flags for these options."""
        out = ["--policy", self.policy]
        if self.policy == "manual":
            out += ["--assignment-mode", self.assignment_mode]
        out += [
            "--health-check-interval-secs", str(self.health_interval_s),
            "--health-check-timeout-secs", str(self.health_timeout_s),
            "--health-failure-threshold", str(self.health_failure_threshold),
            "--health-success-threshold", str(self.health_success_threshold),
            "--cb-failure-threshold", str(self.cb_failure_threshold),
            "--cb-timeout-duration-secs", str(self.cb_timeout_s),
            "--request-timeout-secs", str(self.request_timeout_s),
            "--log-level", self.log_level,
        ]  # fmt: skip
        out += ["--disable-retries"] if self.retries <= 1 else ["--retry-max-retries", str(self.retries)]
        return out


def worker_list(doc: Any) -> list[dict[str, Any]]:
    """The worker entries of a ``GET /workers`` answer (a list, or ``{"workers": [...]}``)."""
    items = doc.get("workers", doc) if isinstance(doc, dict) else doc
    return [w for w in items or [] if isinstance(w, dict)]


class Gateway(LoggedChild):
    """One smg process in front of ``worker_urls``, on a free loopback port.

    ``extra_args`` go to ``smg launch`` last. Use as a context manager or call :meth:`start` and
    :meth:`stop`. ``url`` is what clients use (OpenAI routes); ``metrics_url`` is smg's
    Prometheus listener.
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        options: GatewayOptions | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        metrics_port: int | None = None,
        extra_args: Sequence[str] = (),
        log_dir: str | os.PathLike[str] | None = None,
        name: str = "gateway",
        start_timeout: float = 60.0,
    ) -> None:
        if not worker_urls:
            raise ValueError("a gateway needs at least one replica URL")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.options = options or GatewayOptions()
        self.host = host
        self._requested_port = port
        self._requested_metrics_port = metrics_port
        self.extra_args = list(extra_args)
        self.name = name
        self.start_timeout = start_timeout
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._port: int | None = None
        self._metrics_port: int | None = None
        self._log_path: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._finalizer: weakref.finalize[[subprocess.Popen[bytes], IO[bytes]], Gateway] | None = None

    # ----------------------------------------------------------------- properties
    @property
    def url(self) -> str:
        """The gateway's base URL (clients add ``/v1/...``)."""
        if self._port is None:
            raise ServerError(f"{self.name} has not been started")
        return f"http://{self.host}:{self._port}"

    @property
    def metrics_url(self) -> str:
        """smg's Prometheus endpoint."""
        if self._metrics_port is None:
            raise ServerError(f"{self.name} has not been started")
        return f"http://{self.host}:{self._metrics_port}/metrics"

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def command(self, port: int, metrics_port: int) -> list[str]:
        """The ``smg launch`` command line."""
        return [
            *smg_command(), "launch",
            "--host", self.host, "--port", str(port),
            "--worker-urls", *self.worker_urls,
            "--prometheus-host", self.host, "--prometheus-port", str(metrics_port),
            "--disable-tokenizer-autoload",
            *self.options.args(), *self.extra_args,
        ]  # fmt: skip

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = None) -> Gateway:
        """Start smg and wait until every replica is registered and healthy."""
        if self._proc is not None and self._proc.poll() is None:
            raise ServerError(f"{self.name} is already running (pid {self._proc.pid})")
        port = self._requested_port or free_port(self.host)
        metrics_port = self._requested_metrics_port or free_port(self.host)
        log_dir = self._log_dir or default_log_dir()
        log_dir.mkdir(parents=True, exist_ok=True)
        self._port, self._metrics_port = port, metrics_port
        self._log_path = log_dir / f"{self.name}-{port}.log"
        cmd = self.command(port, metrics_port)
        log.info("starting %s: %s (log %s)", self.name, " ".join(cmd), self._log_path)
        self._proc, log_file = spawn_logged(cmd, self._log_path)
        self._log_file = log_file
        self._finalizer = weakref.finalize(self, _finalize, self._proc, log_file)
        try:
            self.wait_workers(self.start_timeout if timeout is None else timeout)
        except ServerError:
            self.stop()
            raise
        return self

    def wait_workers(self, timeout: float, urls: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Wait until the replicas ``urls`` (default all) are registered and healthy; their entries."""
        want = {u.rstrip("/") for u in (urls or self.worker_urls)}
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while True:
            if self.returncode is not None:
                raise ServerError(
                    f"{self.name} exited during startup", exit_status=self.returncode, log_tail=self.log_tail()
                )
            try:
                workers = self.workers()
                healthy = [w for w in workers if w.get("url") in want and w.get("is_healthy")]
                if len(healthy) == len(want):
                    log.info("%s ready at %s with %d healthy replicas", self.name, self.url, len(healthy))
                    return healthy
                last = f"{len(healthy)}/{len(want)} replicas healthy"
            except (httpx.TransportError, ServerError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise ServerError(f"{self.name} not ready after {timeout:.0f}s ({last})", log_tail=self.log_tail())
            time.sleep(0.2)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM smg, wait ``timeout`` s, then SIGKILL. Returns the exit status."""
        if self._proc is None:
            return None
        status = _terminate_group(self._proc, timeout)
        self._release()
        log.info("%s (pid %d) stopped with status %s", self.name, self._proc.pid, status)
        return status

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of smg's log."""
        return "" if self._log_path is None else read_log_tail(self._log_path, n)

    # ------------------------------------------------------------------ worker API
    def _api(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = httpx.request(method, f"{self.url}{path}", timeout=10.0, trust_env=False, **kwargs)
        if resp.status_code >= 400:
            raise ServerError(f"{self.name} {method} {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json() if resp.content else None

    def workers(self) -> list[dict[str, Any]]:
        """The gateway's replicas (``GET /workers``): ``id``, ``url``, ``is_healthy``, ``load`` ..."""
        return worker_list(self._api("GET", "/workers"))

    @staticmethod
    def list_workers(url: str) -> list[dict[str, Any]]:
        """``GET /workers`` of the smg gateway at ``url`` (one this process did not start)."""
        resp = httpx.get(f"{url.rstrip('/')}/workers", timeout=10.0, trust_env=False)
        if resp.status_code >= 400:
            raise ServerError(f"{url}/workers: HTTP {resp.status_code}: {resp.text[:300]}")
        return worker_list(resp.json())

    def worker_id(self, url: str) -> str:
        """The gateway's id of the replica at ``url``."""
        url = url.rstrip("/")
        for w in self.workers():
            if w.get("url") == url:
                return str(w["id"])
        raise ServerError(f"{self.name} has no replica {url}")

    def reregister(self, url: str, timeout: float = 30.0) -> None:
        """Bring a replica that came back into rotation again (``PUT /workers/{id}``), and wait for it.

        smg never probes a replica again once it marked it failed (down for ``3 x`` the failure
        threshold); re-registering runs its registration again.
        """
        wid = self.worker_id(url)
        self._api("PUT", f"/workers/{wid}", json={"url": url.rstrip("/")})
        self.wait_workers(timeout, [url])

    def metrics(self) -> dict[str, float]:
        """smg's Prometheus metrics, parsed (per-replica series are labelled ``worker="<url>"``)."""
        resp = httpx.get(self.metrics_url, timeout=10.0, trust_env=False)
        resp.raise_for_status()
        return parse_metrics(resp.text)

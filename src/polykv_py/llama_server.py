"""Start, watch and stop a llama-server process (patched or reference).

:class:`LlamaServer` runs one binary on a free loopback port, in its own process
group, logging to a file of its own.  It is ready when ``GET /health`` answers 200;
a 503 "Loading model" means it is still loading.  A process that exits or a start
that times out raises :class:`~polykv_py.errors.ServerError` with the exit status
and the tail of the log.  Every started server is also registered with a
``weakref.finalize`` (which runs at interpreter exit), so no server outlives the
Python process that started it, even when a test fails half-way.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any, TypeVar

import httpx
import psutil

from .errors import ServerError
from .models import resolve_model
from .native import ServerKind, server_binary

if TYPE_CHECKING:
    from .client import AsyncClient, Client

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Default number of CPU threads given to a server (``-t``).
DEFAULT_THREADS = 2
#: Seconds a start may take before it is declared failed.
DEFAULT_START_TIMEOUT = 120.0
#: Seconds ``stop()`` waits after SIGTERM before it sends SIGKILL.
DEFAULT_STOP_TIMEOUT = 10.0

_BIND_FAILURE = "couldn't bind HTTP server socket"
_PR_SET_PDEATHSIG = 1
_counter = itertools.count(1)
_log_root: Path | None = None
_log_root_lock = threading.Lock()


@dataclass(frozen=True)
class ProcessUsage:
    """Memory and CPU readings summed over a server's process tree."""

    rss_bytes: int
    cpu_user_s: float
    cpu_system_s: float
    n_processes: int

    @property
    def cpu_s(self) -> float:
        """User plus system CPU seconds."""
        return self.cpu_user_s + self.cpu_system_s


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def default_log_dir() -> Path:
    """One temporary directory per Python process for the server logs."""
    global _log_root
    with _log_root_lock:
        if _log_root is None:
            _log_root = Path(tempfile.mkdtemp(prefix="polykv-servers-"))
        return _log_root


def connect_host(host: str) -> str:
    """The host part of a URL that reaches a server bound to ``host``.

    A wildcard address (``0.0.0.0``, ``::``) is reached on loopback; an IPv6 literal gets brackets.
    """
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def read_log_tail(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of a log file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            lines: deque[bytes] = deque(f, maxlen=n)
    except FileNotFoundError:
        return ""
    return b"".join(lines).decode("utf-8", errors="replace").rstrip("\n")


def _load_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl() if sys.platform.startswith("linux") else None  # resolved here, never in the child


def _set_pdeathsig() -> None:
    """Runs in the child between fork and exec: SIGKILL it when its parent thread dies."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _terminate_group(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """SIGTERM the process group of ``proc``, wait, then SIGKILL it. Returns the exit status."""
    if proc.poll() is not None:
        return proc.returncode  # already reaped: its group id may belong to someone else by now
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("llama-server pid %d ignored SIGTERM for %.1fs; sending SIGKILL", proc.pid, timeout)
    # the leader is exited but not yet reaped by anyone else, so pgid is still ours:
    # make sure nothing of its group survives
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    return proc.returncode


def spawn_logged(
    cmd: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None, die_with_parent: bool | None = None
) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    """Start ``cmd`` in its own process group, stdout and stderr to ``log_path``: (process, open log file).

    ``die_with_parent`` (default: when called from the main thread; PDEATHSIG follows the creating
    *thread*) makes the child SIGKILLed when this process dies. The caller closes the log file once
    the process is reaped (register :func:`_finalize`).
    """
    die = threading.current_thread() is threading.main_thread() if die_with_parent is None else die_with_parent
    log_file = open(log_path, "wb")  # noqa: SIM115 - the process writes it until it is reaped
    try:
        proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_set_pdeathsig if die and _PRCTL is not None else None,  # noqa: PLW1509 - see above
        )
    except OSError as exc:
        log_file.close()
        raise ServerError(f"cannot execute {cmd[0]}: {exc}") from exc
    return proc, log_file


def _finalize(proc: subprocess.Popen[bytes], log_file: IO[bytes]) -> None:
    """Finalizer registered for every started server (also runs at interpreter exit)."""
    _terminate_group(proc, timeout=5.0)
    log_file.close()


class LoggedChild:
    """What a started child process leaves to clean up: its finalizer and its open log file."""

    _finalizer: weakref.finalize[Any, Any] | None = None
    _log_file: IO[bytes] | None = None

    def _release(self) -> None:
        """Forget the finalizer and close the log file once the process is gone."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


class LlamaServer(LoggedChild):
    """One llama-server process bound to a free loopback port.

    ``binary`` defaults to :func:`~polykv_py.native.server_binary` of ``kind``;
    ``model`` to :func:`~polykv_py.models.resolve_model`. ``args`` are passed last, so
    they win over the defaults (``-t threads``; ``threads=None`` and ``metrics=False`` leave
    those flags out). The server's environment is this process's without the
    ``LLAMA_ARG_*`` variables (llama-server reads its flags from them), unless
    ``inherit_llama_env``; ``env`` is added to it. Use as a context manager or call
    :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        binary: str | os.PathLike[str] | None = None,
        model: str | os.PathLike[str] | None = None,
        args: Sequence[str | int | float] = (),
        *,
        kind: ServerKind | str = ServerKind.PATCHED,
        host: str = "127.0.0.1",
        port: int | None = None,
        threads: int | None = DEFAULT_THREADS,
        api_key: str | None = None,
        metrics: bool = True,
        log_dir: str | os.PathLike[str] | None = None,
        name: str | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        die_with_parent: bool | None = None,
        inherit_llama_env: bool = False,
    ) -> None:
        self.kind = kind = ServerKind.of(kind)
        self.binary = Path(binary) if binary is not None else server_binary(kind)
        self.model = resolve_model(model)
        self.args = [str(a) for a in args]
        if kind is ServerKind.UPSTREAM and any(a.split("=", 1)[0] == "--pool-slots" for a in self.args):
            # libllama-common is shared, so the reference binary would parse the flag and silently ignore it
            raise ServerError("--pool-slots is polykv's option (patch 0073): the reference server ignores it")
        self.host = host
        self._requested_port = port
        self.threads = threads
        self.api_key = api_key
        self.metrics = metrics
        self.name = name or kind.value
        self.start_timeout = start_timeout
        self._extra_env = dict(env or {})
        self._die_with_parent = die_with_parent
        self._inherit_llama_env = inherit_llama_env
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._port: int | None = None
        self._log_path: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[[subprocess.Popen[bytes], IO[bytes]], LlamaServer] | None = None
        self._log_file: IO[bytes] | None = None
        self._client: Client | None = None

    # ----------------------------------------------------------------- properties
    def _started(self, value: _T | None) -> _T:
        """``value``, which exists once the server has been started."""
        if value is None:
            raise ServerError(f"{self.name} server has not been started")
        return value

    @property
    def port(self) -> int:
        """The TCP port (chosen at start)."""
        return self._started(self._port)

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:43123`` (a wildcard bind address is reached on loopback)."""
        return f"http://{connect_host(self.host)}:{self.port}"

    @property
    def log_path(self) -> Path:
        """The server's log file (stdout and stderr)."""
        return self._started(self._log_path)

    @property
    def pid(self) -> int:
        """Process id of the server (also its process group id)."""
        return self._started(self._proc).pid

    @property
    def returncode(self) -> int | None:
        """Exit status once the process has ended, else None (negative: killed by that signal)."""
        return None if self._proc is None else self._proc.poll()

    @property
    def client(self) -> Client:
        """A :class:`~polykv_py.client.Client` bound to this server (created on first use)."""
        from .client import Client

        if self._client is None:
            self._client = Client(self.url, api_key=self.api_key, server=self)
        return self._client

    def async_client(self, **kwargs: Any) -> AsyncClient:
        """A new :class:`~polykv_py.client.AsyncClient` bound to this server (caller closes it).

        ``kwargs``: the client's other options (``timeout``, ``max_connections``, ``transport``).
        """
        from .client import AsyncClient

        return AsyncClient(self.url, api_key=self.api_key, server=self, **kwargs)

    def command(self, port: int) -> list[str]:
        """The command line used for ``port``."""
        cmd = [str(self.binary), "-m", str(self.model), "--host", self.host, "--port", str(port)]
        if self.threads is not None:
            cmd += ["-t", str(self.threads)]
        if self.metrics:
            cmd.append("--metrics")
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + self.args

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = None) -> LlamaServer:
        """Start the process and wait until ``/health`` says it is ready."""
        if self._proc is not None and self._proc.poll() is None:
            raise ServerError(f"{self.name} server is already running (pid {self._proc.pid})")
        timeout = self.start_timeout if timeout is None else timeout
        attempts = 1 if self._requested_port is not None else 3
        for attempt in range(1, attempts + 1):
            self._spawn(self._requested_port or free_port(self.host))
            try:
                self._wait_ready(timeout)
                return self
            except ServerError as exc:
                if attempt < attempts and _BIND_FAILURE in exc.log_tail:
                    log.info("port %d was taken before %s bound it; retrying", self._port, self.name)
                    continue
                raise
        raise AssertionError("unreachable")

    def restart(self, timeout: float | None = None) -> LlamaServer:
        """Stop the process (or reap it, if it died) and start it again, on the same port when it is free.

        Keeping the port keeps :attr:`url` valid for clients made before the restart (e.g. a
        :class:`~polykv_py.fanout.Fanout` re-primes through the same client). Only when
        no port was requested and the old one has been taken in between is a new free port
        chosen (logged; read :attr:`url` again). The KV cache starts empty: re-prime pools.
        """
        old_port = self._port
        self.stop()
        if old_port is None or self._requested_port is not None:
            return self.start(timeout)
        self._requested_port = old_port
        try:
            return self.start(timeout)
        except ServerError as exc:
            if _BIND_FAILURE not in exc.log_tail:
                raise
            log.warning("%s: port %d was taken during the restart; using a new port", self.name, old_port)
        finally:
            self._requested_port = None
        return self.start(timeout)

    def _spawn(self, port: int) -> None:
        log_dir = self._log_dir or default_log_dir()
        log_dir.mkdir(parents=True, exist_ok=True)
        self._port = port
        self._log_path = log_dir / f"{self.name}-{port}-{next(_counter)}.log"
        self._client = None
        cmd = self.command(port)
        env = {k: v for k, v in os.environ.items() if self._inherit_llama_env or not k.startswith("LLAMA_ARG_")}
        env.update(self._extra_env)
        log.info("starting %s: %s (log %s)", self.name, " ".join(_redact(cmd)), self._log_path)
        self._proc, log_file = spawn_logged(cmd, self._log_path, env=env, die_with_parent=self._die_with_parent)
        self._log_file = log_file
        self._finalizer = weakref.finalize(self, _finalize, self._proc, log_file)

    def _wait_ready(self, timeout: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        with httpx.Client(timeout=5.0, trust_env=False) as http:
            while True:
                status = self._proc.poll()
                if status is not None:
                    self._release()
                    raise ServerError(
                        f"{self.name} llama-server exited during startup", exit_status=status, log_tail=self.log_tail()
                    )
                try:
                    resp = http.get(f"{self.url}/health")
                    if resp.status_code == 200:
                        log.info("%s ready at %s (pid %d)", self.name, self.url, self._proc.pid)
                        return
                    last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    if resp.status_code != 503 or "loading" not in resp.text.lower():
                        log.debug("%s health not ready: %s", self.name, last)
                except httpx.TransportError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise ServerError(
                        f"{self.name} llama-server not ready after {timeout:.0f}s (last health answer: {last})",
                        log_tail=tail,
                    )
                time.sleep(0.1)

    def health_state(self) -> str:
        """``"ok"``, ``"loading"``, ``"error"`` (any other answer), ``"unreachable"`` or ``"dead"``."""
        if not self.is_alive():
            return "dead"
        try:
            resp = httpx.get(f"{self.url}/health", timeout=5.0, trust_env=False)
        except httpx.TransportError:
            return "unreachable"
        if resp.status_code == 200:
            return "ok"
        if resp.status_code == 503 and "loading" in resp.text.lower():
            return "loading"
        return "error"

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the process to exit (at most ``timeout`` s); its exit status, or None while it runs."""
        proc = self._started(self._proc)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def is_alive(self) -> bool:
        """True while the server process runs."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT) -> int | None:
        """SIGTERM the process group, wait ``timeout`` s, then SIGKILL. Returns the exit status."""
        if self._proc is None:
            return None
        if self._client is not None:
            self._client.close()
            self._client = None
        status = _terminate_group(self._proc, timeout)
        self._release()
        log.info("%s (pid %d) stopped with status %s", self.name, self._proc.pid, status)
        return status

    def __enter__(self) -> LlamaServer:
        return self.start() if not self.is_alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else "stopped"
        where = f" {self.url}" if self._port is not None else ""
        return f"<LlamaServer {self.name} {state}{where}>"

    # ------------------------------------------------------------------ readings
    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server log."""
        return "" if self._log_path is None else read_log_tail(self._log_path, n)

    def processes(self) -> list[psutil.Process]:
        """The server process and all its descendants (empty once it has exited)."""
        if not self.is_alive():
            return []
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def usage(self) -> ProcessUsage:
        """Resident memory and CPU seconds of the process tree, now."""
        rss = 0
        user = system = 0.0
        procs = self.processes()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied), p.oneshot():
                rss += p.memory_info().rss
                t = p.cpu_times()
                user += t.user
                system += t.system
        return ProcessUsage(rss_bytes=rss, cpu_user_s=user, cpu_system_s=system, n_processes=len(procs))


def _redact(cmd: list[str]) -> list[str]:
    out = list(cmd)
    for i, arg in enumerate(out[:-1]):
        if arg == "--api-key":
            out[i + 1] = "***"
    return out


class Stop(Exception):  # noqa: N818 - a signal, not an error
    """Raised in the main thread by SIGTERM or SIGINT (:func:`stop_on_signals`): a launcher stops its servers."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`Stop` once (later ones are ignored while stopping)."""
    raised = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal raised
        if raised:
            log.info("%s: already stopping", signal.Signals(signum).name)
            return
        raised = True
        raise Stop(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, prev in old.items():
            signal.signal(sig, prev)

"""``polykv serve``: llama-server as a child process, its pools primed before it is announced ready.

The launcher starts the patched server on the requested host and port with the pool
defaults (:data:`~polykv_py.presets.SERVE_DEFAULTS`), reserves one pool slot per
``--pool``/``--pool-chat`` file (slots 0..k-1, :func:`~polykv_py.presets.serve_pool_args`),
adds ``--pool-auto`` when the binary knows it (so plain OpenAI-style requests share the
pools), waits for ``/health``, primes every pool with a pinned request
(:func:`prime_pools`; from the pool cache when a file for this model and these tokens is
there, and saved to it otherwise), logs one line per pool, and only then prints that the
server is ready. It then waits for the child: SIGTERM or SIGINT stop it gracefully (SIGTERM to its
process group, SIGKILL after a grace period), and a child that dies on its own makes the
launcher exit with the child's status and the tail of its log.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from .client import Client
from .errors import HTTPError, PolykvError, ServerError
from .llama_server import LlamaServer, Stop, stop_on_signals
from .models import is_default_model, resolve_model
from .native import ServerKind, server_binary
from .pools import PoolCache, pool_file_name
from .presets import (
    NO_SHARE_ANY,
    POOL_AUTO,
    SERVE_AGENT_SLOTS,
    SERVE_AUTO_POOLS,
    SERVE_DEFAULTS,
    SHARE_ANY,
    serve_pool_args,
    stock_serve_args,
    template_args,
)
from .promoted import PromotedPoolKeeper, restore_promoted

log = logging.getLogger("polykv.serve")

#: How a pool file becomes the pool's prompt: as it is, or as a chat system message.
PoolKind = Literal["text", "chat"]
#: Seconds ``polykv serve`` waits for the model to load.
SERVE_START_TIMEOUT = 600.0
#: Seconds ``--help`` may take when probing the binary for a flag.
HELP_TIMEOUT = 30.0
#: Seconds between two looks at the promoted pools (saved to the pool cache when new).
PROMOTED_POLL_S = 2.0


@dataclass(frozen=True)
class PoolSpec:
    """One reserved pool: its slot, the text it holds and where that came from.

    ``kind="text"``: the pool holds the text as it is (completion prompts that start with it
    share it); ``"chat"``: it holds the chat-template rendering of one system message whose
    content is the text (chat requests whose first message is that system message share it).
    """

    slot: int
    text: str
    kind: PoolKind = "text"
    source: str = ""

    def prompt(self, client: Client) -> str:
        """The prompt to prime: the text, or its rendering as a system message (no generation prompt)."""
        if self.kind == "chat":
            messages = [{"role": "system", "content": self.text}]
            return client.apply_template(messages, add_generation_prompt=False)
        return self.text


@dataclass(frozen=True)
class PrimedPool:
    """A primed pool: its slot, where its text came from, its tokens and the seconds priming took
    (``restored_from``: the pool file it was restored from instead of computing it)."""

    slot: int
    source: str
    n_tokens: int
    seconds: float
    restored_from: str | None = None


def load_pools(files: Sequence[tuple[PoolKind, str]]) -> list[PoolSpec]:
    """One pool per ``(kind, path)``, in order, in slots 0, 1, ... (the files are read here)."""
    pools = []
    for slot, (kind, path) in enumerate(files):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise PolykvError(f"cannot read pool file {path}: {exc}") from exc
        if not text:
            raise PolykvError(f"pool file {path} is empty")
        pools.append(PoolSpec(slot, text, kind, path))
    return pools


def prime_pools(
    client: Client, pools: Sequence[PoolSpec], *, salt: str | None = None, cache: PoolCache | None = None
) -> list[PrimedPool]:
    """Prime each pool with a pinned request (``Client.prime``: processed, nothing generated), in order.

    ``salt`` is sent as ``cache_salt``: only requests with the same salt then share the pool.
    With ``cache`` (the server's ``--slot-save-path``) a pool whose file is there is restored
    instead, and a computed one is saved; a save that fails (the server refuses it: disk full,
    a read-only directory, ...) is logged as a warning naming the pool and the reason, and the
    pool, primed, is served all the same. Logs one line per pool.
    """
    salt = salt or None
    params: dict[str, Any] = {"cache_salt": salt} if salt else {}
    identity = client.pool_features().pool_files if cache is not None else None
    out = []
    for pool in pools:
        text = pool.prompt(client)
        source = pool.source or f"pool {pool.slot}"
        name, tokens = None, None
        if identity is not None:  # the file is named by the tokens (and restored only if it holds them)
            tokens = client.prompt_tokens(text)
            name = pool_file_name(identity, tokens, salt)
        prompt: str | list[int] = tokens if tokens is not None else text
        t0 = time.perf_counter()
        if name is not None and tokens is not None and _restore(client, pool.slot, name, tokens, salt):
            assert cache is not None
            cache.restored(name)
            primed = PrimedPool(pool.slot, source, len(prompt), time.perf_counter() - t0, restored_from=name)
        else:
            answer = client.prime(prompt, pool.slot, **params)
            n_tokens = int(answer.get("tokens_evaluated") or (answer.get("timings") or {}).get("prompt_n") or 0)
            primed = PrimedPool(pool.slot, source, n_tokens, time.perf_counter() - t0)
            if name is not None:
                assert cache is not None
                _save(client, cache, pool.slot, source, name, salt)
        log.info(
            "pool slot %d: %s (%s), %d tokens %s in %.2fs%s",
            primed.slot,
            primed.source,
            pool.kind,
            primed.n_tokens,
            f"restored from the pool cache ({name})" if primed.restored_from else "primed",
            primed.seconds,
            " (salted)" if salt else "",
        )
        out.append(primed)
    return out


def warn_if_no_tools(client: Client) -> bool:
    """Warn when the server's chat template cannot render tools (``/props`` ``chat_template_caps``): the
    server then drops a request's tool list, and its ``tool_choice``, without an error. True when it can."""
    caps = client.props().get("chat_template_caps") or {}
    if caps.get("supports_tools", True):
        return True
    log.warning(
        "the model's chat template cannot render tools: a request's tools (and tool_choice) are dropped without "
        "an error, as the stock server does; give one that can: polykv serve -- --chat-template-file FILE "
        "(docs/agents.md#tools)"
    )
    return False


def _save(client: Client, cache: PoolCache, slot: int, source: str, name: str, salt: str | None) -> bool:
    """Save primed pool ``slot`` to pool file ``name`` and trim the cache; a failure is logged, not raised
    (the pool is primed: serving it does not need the file)."""
    try:
        client.save_pool(slot, name, cache_salt=salt)
    except HTTPError as exc:
        log.warning(
            "pool slot %d (%s): could not save it to the pool cache as %s: %s; serving it without a pool file",
            slot,
            source,
            name,
            exc.server_message or exc,
        )
        return False
    cache.saved(name)
    return True


def _restore(client: Client, slot: int, name: str, tokens: list[int], salt: str | None) -> bool:
    """Restore ``slot`` from pool file ``name``: False on a miss, or (logged) on a refused file."""
    try:
        client.restore_pool(slot, name, tokens=tokens, cache_salt=salt)
    except HTTPError as exc:
        PoolCache.restore_failed(exc, name)
        return False
    return True


def supports_flag(binary: str | os.PathLike[str], flag: str) -> bool:
    """True when ``binary --help`` lists ``flag`` (a llama-server prints its flags without a model)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    try:
        proc = subprocess.run(
            [str(binary), "--help"], capture_output=True, timeout=HELP_TIMEOUT, env=env, check=False, text=True
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("could not ask %s for its flags: %s", binary, exc)
        return False
    return any(word.strip(",") == flag for word in (proc.stdout + proc.stderr).split())


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost, a UNIX socket)."""
    import ipaddress

    if host == "localhost" or host.endswith(".sock"):
        return True
    try:
        return all(ipaddress.ip_address(h.strip().strip("[]")).is_loopback for h in host.split(","))
    except ValueError:
        return False


def take_option(args: list[str], *names: str) -> str | None:
    """Remove every ``NAME VALUE`` / ``NAME=VALUE`` of ``names`` from ``args``; the last value, or None."""
    value = None
    i = 0
    while i < len(args):
        name, eq, inline = args[i].partition("=")
        if name in names:
            if eq:
                value = inline
                del args[i]
            elif i + 1 < len(args):
                value = args[i + 1]
                del args[i : i + 2]
            else:
                raise PolykvError(f"{name} needs a value")
            continue
        i += 1
    return value


@dataclass
class ServeOptions:
    """What ``polykv serve`` was asked for (the command line, parsed)."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    upstream: bool = False
    no_defaults: bool = False
    server_args: list[str] = field(default_factory=list)
    pools: list[tuple[PoolKind, str]] = field(default_factory=list)
    pool_salt: str | None = None
    pool_cache: str | None = None  # None: the default pool cache (with --pool files)
    no_pool_cache: bool = False
    pool_auto: bool | None = None  # None: when the binary knows --pool-auto
    agent_slots: int = SERVE_AGENT_SLOTS
    reserve_pools: int = 0  # reserve at least this many pool slots (for pools clients prime, e.g. through a gateway)
    auto_pools: int = SERVE_AUTO_POOLS  # more reserved slots, for the prefixes --share-any promotes
    log_dir: str | None = None
    start_timeout: float = SERVE_START_TIMEOUT


def build_server(opts: ServeOptions) -> tuple[LlamaServer, list[PoolSpec], PoolCache | None]:
    """The server ``opts`` asks for (not started), the pools to prime once it is up, and their cache.

    ``--host``, ``--port`` and ``--api-key`` given among the llama-server flags (after ``--``)
    win over the launcher's own options, as they would on llama-server's command line, and
    the launcher uses them too (to reach the server and prime its pools).
    """
    extra = list(opts.server_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    host = take_option(extra, "--host") or opts.host
    port_text = take_option(extra, "--port")
    api_key = take_option(extra, "--api-key") or opts.api_key or os.environ.get("LLAMA_ARG_API_KEY") or None
    try:
        port = int(port_text) if port_text is not None else opts.port
    except ValueError:
        raise PolykvError(f"--port must be an integer, not {port_text!r}") from None
    if host.endswith(".sock"):
        raise PolykvError("polykv serve reaches its server over TCP (health, pools): use llama-server for a socket")
    pools = load_pools(opts.pools)
    kind = ServerKind.UPSTREAM if opts.upstream else ServerKind.PATCHED
    binary = server_binary(kind)
    if opts.upstream and (pools or opts.pool_auto):
        raise PolykvError("pools are polykv's (--pool-slots): the reference server (--upstream) has none")
    if pools and any(a.split("=", 1)[0] == "--pool-slots" for a in extra):
        raise PolykvError("--pool and --pool-chat reserve slots 0..k-1 themselves: drop --pool-slots")
    if opts.pool_salt and not pools:
        raise PolykvError("--pool-salt salts the pools primed from --pool/--pool-chat: give one")
    if opts.auto_pools < 0:
        raise PolykvError(f"--auto-pools must be >= 0, not {opts.auto_pools}")
    share_any = not opts.upstream and _last_flag([*([] if opts.no_defaults else SERVE_DEFAULTS), *extra]) == SHARE_ANY
    cache = None
    if (pools or share_any) and not opts.no_pool_cache:  # the server's --slot-save-path is the cache
        cache = PoolCache(take_option(extra, "--slot-save-path") or opts.pool_cache or PoolCache.default().directory)
        extra += ["--slot-save-path", str(cache.save_path)]
    if opts.upstream:  # the stock server with its defaults, and the slots polykv serve would have
        n_slots = max(opts.auto_pools, opts.reserve_pools, 1) + opts.agent_slots
        args: list[str] = [] if opts.no_defaults else stock_serve_args(n_slots)
    else:
        args = [] if opts.no_defaults else list(SERVE_DEFAULTS)
    model = resolve_model(opts.model)
    args += template_args(is_default_model(model), [*args, *extra])
    if not opts.upstream and (pools or not opts.no_defaults):
        pool_auto = opts.pool_auto
        if pool_auto is None:
            pool_auto = supports_flag(binary, POOL_AUTO)
            if not pool_auto:
                log.info("%s has no %s: plain requests will not share the pools", binary.name, POOL_AUTO)
        n_pools = max(len(pools) + (opts.auto_pools if share_any else 0), opts.reserve_pools)
        args += serve_pool_args(n_pools, opts.agent_slots, pool_auto=pool_auto and POOL_AUTO not in extra)
    server = LlamaServer(
        binary,
        model,
        [*args, *extra],
        kind=kind,
        host=host,
        port=port,
        threads=None,  # -t is among the defaults, or the user's to give
        metrics=False,  # likewise --metrics
        api_key=api_key,
        log_dir=opts.log_dir,
        name="polykv-serve" if not opts.upstream else "polykv-serve-upstream",
        start_timeout=opts.start_timeout,
        inherit_llama_env=True,  # the user's LLAMA_ARG_* settings reach the server, as they did with exec
    )
    if not is_loopback(host):
        log.warning(
            "binding %s: reachable from other machines%s",
            host,
            "" if api_key else " with no API key (anyone can prompt, prime and erase slots)",
        )
    return server, pools, cache


def _last_flag(args: Sequence[str]) -> str | None:
    """Whichever of ``--share-any`` / ``--no-share-any`` comes last in ``args`` (llama-server's rule)."""
    flags = [a for a in args if a in (SHARE_ANY, NO_SHARE_ANY)]
    return flags[-1] if flags else None


def exit_code(status: int | None) -> int:
    """A process exit status as the launcher's own exit code (killed by signal N: 128 + N)."""
    if status is None:
        return 1
    return 128 - status if status < 0 else status


def supervise(
    server: LlamaServer,
    pools: Sequence[PoolSpec],
    *,
    salt: str | None = None,
    out: TextIO | None = None,
    cache: PoolCache | None = None,
) -> int:
    """Start ``server``, prime ``pools``, say it is ready on ``out`` (stdout), and wait for it.

    Returns the exit code: the child's status after a SIGTERM/SIGINT stopped it (0 when it
    stopped cleanly) or after it died on its own (logged with its log tail), 1 when it could
    not be started or primed.
    """
    out = out if out is not None else sys.stdout
    with stop_on_signals():
        try:
            return _run(server, pools, salt, out, cache)
        except Stop as stop:
            log.info("%s: stopping llama-server (pid %s)", stop, server.pid if server.is_alive() else "-")
            status = server.stop()
            log.info("llama-server stopped (exit status %s)", status)
            return exit_code(status) if status else 0
        finally:
            if server.is_alive():
                server.stop()


def _run(server: LlamaServer, pools: Sequence[PoolSpec], salt: str | None, out: TextIO, cache: PoolCache | None) -> int:
    try:
        server.start()
    except ServerError as exc:
        log.error("%s", exc)
        return exit_code(exc.exit_status)
    log.info("llama-server pid %d at %s, log %s", server.pid, server.url, server.log_path)
    try:
        warn_if_no_tools(server.client)
        prime_pools(server.client, pools, salt=salt, cache=cache)
    except PolykvError as exc:
        if server.is_alive():
            log.error("priming the pools failed: %s", exc)
            return 1
        return _died(server)
    keeper = None
    restored = 0
    if cache is not None and server.client.pool_features().share_any:  # promoted prefixes: kept in the cache
        keeper = PromotedPoolKeeper(server.client, cache)
        free = [s for s in server.client.pool_features().pool_slots if s not in {p.slot for p in pools}]
        try:
            restored = len(restore_promoted(server.client, cache, free))
        except PolykvError as exc:
            log.warning("restoring promoted pools failed: %s", exc)
    promoted = f", {restored} promoted prefix{'es' * (restored != 1)} restored" if restored else ""
    print(
        f"polykv serve: ready at {server.url}/v1 ({len(pools)} pool{'s' * (len(pools) != 1)} primed{promoted}; "
        f"llama-server log: {server.log_path})",
        file=out,
        flush=True,
    )
    while server.wait(timeout=PROMOTED_POLL_S if keeper else None) is None:
        if keeper is not None:
            _poll(keeper, server)
    return _died(server)


def _poll(keeper: PromotedPoolKeeper, server: LlamaServer) -> None:
    """Save new promoted pools; a server that does not answer now is asked again at the next poll."""
    try:
        keeper.poll()
    except PolykvError as exc:
        if server.is_alive():
            log.debug("promoted pools: %s", exc)


def _died(server: LlamaServer) -> int:
    status = server.wait(timeout=5.0)
    tail = server.log_tail()
    server.stop()  # reap what is left of its group, close the log
    log.log(
        logging.ERROR if status else logging.WARNING,
        "llama-server exited on its own with status %s%s",
        status,
        f"\n--- server log tail ---\n{tail}" if tail else "",
    )
    return exit_code(status) if status else 0


def serve(opts: ServeOptions, out: TextIO | None = None) -> int:
    """``polykv serve``: build the server, start it, prime its pools, wait. Returns the exit code."""
    server, pools, cache = build_server(opts)
    return supervise(server, pools, salt=opts.pool_salt, out=out, cache=cache)

"""Server recipes, one function each (llama.cpp's ``ServerPreset``).

Every command, harness and test that starts a llama-server for polykv takes its flags
from here, so a recipe is written once:

- :func:`pool_server`: the patched server set up for a fan-out (unified KV, reserved
  pool slot, idle slots kept resident, no host prompt cache);
- :func:`reference_server`: the pristine server with the same flags minus polykv's own;
- :data:`SERVE_DEFAULTS` and :func:`serve_pool_args`: what ``polykv serve`` adds unless told
  otherwise, and its reserved pools; :func:`serve_server` is the same server for tests.

The returned :class:`~polykv_py.llama_server.LlamaServer` objects are not started yet.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .llama_server import DEFAULT_THREADS, LlamaServer
from .native import ServerKind

#: Environment a server needs to print its KV usage (read by :mod:`polykv_py.harness.kvcells`).
KV_DEBUG_ENV = {"LLAMA_KV_CACHE_DEBUG": "1"}
#: Server flags it needs (debug verbosity, so libllama's debug lines reach the log).
KV_DEBUG_ARGS = ("-lv", "5")

#: The seed's name for upstream's ``--no-cache-idle-slots`` (patch 0072 adds it as an alias).
NO_CLEAR_IDLE = "--no-clear-idle"
#: Upstream's own name: keep idle slots resident (the reference server knows only this one).
NO_CACHE_IDLE = "--no-cache-idle-slots"
#: Unified KV: one buffer for all slots, so a share only adds the agent's sequence id to the pool's cells.
UNIFIED_KV = "-kvu"
#: No host prompt cache: with it, a slot restores an agent's old prompt from RAM as a private copy of the
#: prefix (status own_cache, P more cells) instead of sharing the pool's cells.
NO_HOST_CACHE = ("--cache-ram", "0")

#: Flags a pool server needs: unified KV (sharing without copies), idle slots kept resident, /slots, and
#: no host prompt cache.
POOL_SERVER_ARGS = (UNIFIED_KV, NO_CLEAR_IDLE, *NO_HOST_CACHE, "--slots")
#: The same for the reference server (upstream's flag name; no pool slot to reserve).
REFERENCE_SERVER_ARGS = (UNIFIED_KV, NO_CACHE_IDLE, *NO_HOST_CACHE, "--slots")

#: polykv's decode attention over shared cells (patch 0076): on in ``polykv serve``, ``polykv run``,
#: ``polykv cluster`` and the benchmarks' polykv systems; the server binary's own default stays off.
SHARED_DECODE = "--shared-decode"
#: The opt-out (a later flag wins over an earlier one on llama-server's command line).
NO_SHARED_DECODE = "--no-shared-decode"

#: polykv's zero-config sharing (patch 0077): a prompt shares the longest computed prefix any slot of its
#: cache_salt holds and waits for a slot computing one; on in ``polykv serve``, ``polykv run``, ``polykv cluster``
#: and the benchmarks' polykv systems; the server binary's own default stays off.
SHARE_ANY = "--share-any"
#: The opt-out (a later flag wins).
NO_SHARE_ANY = "--no-share-any"

#: polykv's flag: a plain request (no pool field, not pinned) shares the reserved pool that has the longest
#: common prefix with its prompt (``shared_prefix.auto == "pool"``). Only newer patched servers know it.
POOL_AUTO = "--pool-auto"
#: KV cells ``polykv serve`` gives the server unless told otherwise.
SERVE_CTX = 32768
#: Slots ``polykv serve`` gives agents, besides its reserved pools.
SERVE_AGENT_SLOTS = 8
#: Reserved pool slots ``polykv serve`` adds, beyond its ``--pool`` files, for the prefixes ``--share-any`` promotes.
SERVE_AUTO_POOLS = 2

#: Threads ``polykv serve`` gives the server (and the stock server it compares with) unless told otherwise.
SERVE_THREADS = min(os.cpu_count() or 2, 8)

#: Flags ``polykv serve`` adds unless the user passes ``--no-defaults`` (its pools: :func:`serve_pool_args`).
SERVE_DEFAULTS = (
    *POOL_SERVER_ARGS[:-1], "-c", str(SERVE_CTX),
    "-t", str(SERVE_THREADS), "--metrics", "--slots", SHARED_DECODE, SHARE_ANY,
)  # fmt: skip


#: Flags that choose the chat template: given any of them, ``polykv serve`` adds no template of its own.
CHAT_TEMPLATE_FLAGS = ("--chat-template", "--chat-template-file", "--no-jinja")


def tools_template() -> Path:
    """polykv's ChatML template with tools for the default model (its own template cannot render tools).

    Without tools it renders what the model's own template renders, byte for byte; with tools it lists them
    in the system turn and renders tool calls and results (``tests/integration/test_tools_template.py``).
    """
    return Path(__file__).parent / "data" / "templates" / "chatml-tools.jinja"


def template_args(default_model: bool, args: Sequence[str]) -> list[str]:
    """``--chat-template-file`` with :func:`tools_template` for the default model, unless ``args`` choose one."""
    chosen = any(a.split("=", 1)[0] in CHAT_TEMPLATE_FLAGS for a in args)
    return ["--chat-template-file", str(tools_template())] if default_model and not chosen else []


def stock_serve_args(n_slots: int, *, ctx: int = SERVE_CTX, threads: int | None = None) -> list[str]:
    """``polykv serve --upstream``: the stock server with its own defaults (idle slots cached to host RAM,
    its prompt cache) and what makes it comparable to ``polykv serve``: the same ``n_slots`` slots over the
    same ``ctx`` unified KV cells, the same threads, ``--metrics`` and ``/slots``."""
    return [UNIFIED_KV, *slots_args(n_slots, ctx), "-t", str(threads or SERVE_THREADS), "--metrics", "--slots"]


def slots_args(n_slots: int, ctx: int) -> list[str]:
    """``-np n_slots -c ctx``: the server's slots and the KV cells they share (unified) or split."""
    return ["-np", str(n_slots), "-c", str(ctx)]


def pool_slot_args(pool_slots: Sequence[int]) -> list[str]:
    """``--pool-slots`` for the given slots (patch 0073: reserved, never picked, purged or idle-cleared)."""
    return ["--pool-slots", ",".join(str(s) for s in pool_slots)] if pool_slots else []


def serve_pool_args(n_pools: int, agent_slots: int = SERVE_AGENT_SLOTS, *, pool_auto: bool = False) -> list[str]:
    """``polykv serve``'s pools: ``--pool-slots 0,..,k-1 -np k+agent_slots`` (and ``--pool-auto``).

    ``k = max(n_pools, 1)``: slot 0 is reserved even without a pool to prime (prime it yourself).
    """
    if n_pools < 0 or agent_slots < 1:
        raise ValueError(f"need n_pools >= 0 and agent_slots >= 1, not {n_pools} and {agent_slots}")
    k = max(n_pools, 1)
    return [*pool_slot_args(range(k)), "-np", str(k + agent_slots), *([POOL_AUTO] if pool_auto else [])]


def slot_actions_args(save_path: str | None = None) -> list[str]:
    """``--slot-save-path``: ``save_path`` (a pool cache's directory, with its trailing slash), else a
    fresh directory that only enables the ``/slots`` actions (erase)."""
    return ["--slot-save-path", save_path or tempfile.mkdtemp(prefix="polykv-slots-")]


def kv_debug(track_kv: bool) -> tuple[list[str], dict[str, str] | None]:
    """Flags and environment that make the server log its KV cells in use (or nothing)."""
    return (list(KV_DEBUG_ARGS), dict(KV_DEBUG_ENV)) if track_kv else ([], None)


def pool_server(
    *,
    model: str | os.PathLike[str] | None = None,
    n_agents_parallel: int = 8,
    ctx: int = 16384,
    threads: int | None = None,
    kind: ServerKind | str = ServerKind.PATCHED,
    extra_args: Sequence[str] = (),
    track_kv: bool = True,
    name: str = "polykv-pool",
    pool_slot: int | None = 0,
    env: Mapping[str, str] | None = None,
    slot_save_path: str | None = None,
    shared_decode: bool = False,
    share_any: bool = False,
    **launch: Any,
) -> LlamaServer:
    """A fan-out server: ``n_agents_parallel`` agent slots plus the pool slot ``pool_slot``.

    On the patched server the pool slot is reserved with ``--pool-slots`` (``pool_slot=None``:
    nothing reserved, e.g. to compare scheduling with the reference server); ``ctx`` KV cells
    in all (unified); with ``track_kv`` the debug logging :mod:`polykv_py.harness.kvcells` reads.
    ``kind="upstream"`` gives the reference server with the same flags (its own flag names).
    ``slot_save_path``: the ``--slot-save-path`` (a :class:`~polykv_py.pools.PoolCache`'s
    ``save_path``); default a fresh directory. ``shared_decode``: ``--shared-decode`` (patched only;
    off here so that tests compare upstream's kernel unless they ask; ``polykv run`` turns it on);
    ``share_any``: ``--share-any`` likewise (upstream's slot choice unless asked).
    ``launch`` goes to :class:`~polykv_py.llama_server.LlamaServer` (``binary``, ``log_dir``, ``api_key`` ...).
    """
    kind = ServerKind.of(kind)
    patched = kind is ServerKind.PATCHED
    reserve = pool_slot_args([pool_slot]) if patched and pool_slot is not None else []
    recipe = POOL_SERVER_ARGS if patched else REFERENCE_SERVER_ARGS
    args = [*recipe, *slots_args(n_agents_parallel + 1, ctx), *slot_actions_args(slot_save_path), *reserve]
    if patched and shared_decode:
        args.append(SHARED_DECODE)
    if patched and share_any:
        args.append(SHARE_ANY)
    return custom_server(kind, args, extra_args=extra_args, track_kv=track_kv, model=model, threads=threads, name=name,
                         env=env, **launch)  # fmt: skip


def serve_server(
    n_pools: int,
    *,
    agent_slots: int = SERVE_AGENT_SLOTS,
    ctx: int = SERVE_CTX,
    pool_auto: bool = True,
    slot_actions: bool = False,
    slot_save_path: str | None = None,
    shared_decode: bool = True,
    share_any: bool = True,
    extra_args: Sequence[str] = (),
    threads: int | None = None,
    name: str = "polykv-serve",
    **launch: Any,
) -> LlamaServer:
    """The patched server as ``polykv serve --pool ...`` starts it (``n_pools`` reserved pools,
    ``agent_slots`` more slots, ``ctx`` KV cells, ``--pool-auto``, ``--shared-decode`` unless
    ``shared_decode`` is False, ``--share-any`` unless ``share_any`` is False), on a free loopback port.

    Prime its pools with :func:`polykv_py.serve.prime_pools`, as ``polykv serve`` does.
    ``slot_actions`` adds ``--slot-save-path`` (erasing slots, for tests); ``slot_save_path`` sets it
    (the pool cache's directory).
    """
    args = serve_args(n_pools, agent_slots=agent_slots, ctx=ctx, pool_auto=pool_auto, shared_decode=shared_decode,
                      share_any=share_any)  # fmt: skip
    if slot_actions or slot_save_path:
        args += slot_actions_args(slot_save_path)
    return custom_server(ServerKind.PATCHED, args, extra_args=extra_args, threads=threads, name=name, **launch)


def serve_args(
    n_pools: int,
    *,
    agent_slots: int = SERVE_AGENT_SLOTS,
    ctx: int = SERVE_CTX,
    pool_auto: bool = True,
    shared_decode: bool = True,
    share_any: bool = True,
) -> list[str]:
    """The flags of :func:`serve_server` (``polykv serve``'s recipe), for a caller that starts the server itself."""
    args = [*POOL_SERVER_ARGS, "-c", str(ctx), *serve_pool_args(n_pools, agent_slots, pool_auto=pool_auto)]
    args.append(SHARED_DECODE if shared_decode else NO_SHARED_DECODE)
    args.append(SHARE_ANY if share_any else NO_SHARE_ANY)
    return args


def reference_server(
    *,
    model: str | os.PathLike[str] | None = None,
    n_slots: int = 4,
    ctx: int = 16384,
    threads: int | None = None,
    extra_args: Sequence[str] = (),
    track_kv: bool = False,
    name: str = "reference",
    env: Mapping[str, str] | None = None,
    **launch: Any,
) -> LlamaServer:
    """The pristine server with a pool server's flags (unified KV, idle slots resident, no host cache)."""
    args = [*REFERENCE_SERVER_ARGS, *slots_args(n_slots, ctx), *slot_actions_args()]
    return custom_server(ServerKind.UPSTREAM, args, extra_args=extra_args, track_kv=track_kv, model=model,
                         threads=threads, name=name, env=env, **launch)  # fmt: skip


def custom_server(
    kind: ServerKind | str,
    args: Sequence[str],
    *,
    extra_args: Sequence[str] = (),
    track_kv: bool = False,
    threads: int | None = None,
    env: Mapping[str, str] | None = None,
    **launch: Any,
) -> LlamaServer:
    """A server for a recipe of one's own: ``args``, then the KV debug flags, then ``extra_args`` (which win)."""
    debug_args, debug_env = kv_debug(track_kv)
    full_env = {**(debug_env or {}), **(env or {})}
    return LlamaServer(kind=kind, args=[*args, *debug_args, *extra_args], threads=threads or DEFAULT_THREADS,
                       env=full_env or None, **launch)  # fmt: skip

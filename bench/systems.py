"""The systems a benchmark compares: polykv, and the stock server in each of its useful modes.

A skeptic compares with the stock llama-server at its best, not at its slowest, so every
cell runs each stock mode below and a report names the fastest of them per cell ("best
stock"):

- ``stock``: upstream's defaults for an explicit slot count: one KV stream per slot (no
  ``-kvu``), the 8 GiB host prompt cache and idle-slot caching on;
- ``stock_kvu``: the same with unified KV (``-kvu``): every request also scans the other
  agents' private copies of the base (masked cells are not free);
- ``stock_cache``: streams plus its built-in reuse tuned for a shared base: host prompt
  cache, idle-slot caching, slot prompt similarity 0.1, and the base sent once first;
- ``stock_queued``: the stock server held to the KV budget sharing needs, with as many
  slots as whole prompts fit; the agents queue, and the host prompt cache and similarity
  let a slot take up a cached prompt (the base, or an agent's own transcript) again.

and polykv's modes:

- ``patched``: unified KV, a reserved pool slot primed once, every agent shares its cells, and
  the agents decode over the shared cells together (``--shared-decode``, as ``polykv serve`` runs);
- ``copied``: the patched server without ``-kvu`` (one stream per slot): a share copies the
  pool's whole stream and trims it (status ``copied``), so compute is saved, memory is not;
- ``dropin``: ``patched`` with ``--pool-auto``, and agents that send plain requests (no pool
  field): the server finds the pool and the prefix itself, as for any OpenAI client.

The decode benchmark also runs ``patched_upstream_decode``: ``patched`` with upstream's attention
kernel (``--no-shared-decode``), to measure what the decode path alone buys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from polykv_py.llama_server import LlamaServer
from polykv_py.native import ServerKind
from polykv_py.presets import (
    NO_CLEAR_IDLE,
    NO_SHARED_DECODE,
    SHARED_DECODE,
    custom_server,
    slot_actions_args,
    slots_args,
)

Budget = Literal["copies", "shared"]

#: The stock server's reuse switches for a shared base (host cache, idle caching, similarity).
_STOCK_REUSE = ("--cache-ram", "8192", "--cache-idle-slots", "--slot-prompt-similarity", "0.1")
#: polykv's pool recipe: unified KV, idle slots kept resident, no host cache, slot 0 reserved for the pool.
_POOL = ("-kvu", NO_CLEAR_IDLE, "--cache-ram", "0", "--pool-slots", "0")
#: ... with the agents decoding over the shared cells together, as ``polykv serve`` runs
_POOL_SD = (*_POOL, SHARED_DECODE)


@dataclass(frozen=True)
class System:
    """One server recipe a benchmark cell runs."""

    name: str
    kind: ServerKind
    flags: tuple[str, ...]  # besides -np, -c, threads and logging
    share: bool  # agents send the pool fields
    prime: bool  # the base is sent once before the agents
    budget: Budget  # "copies": room for every agent's own copy; "shared": the sharing budget, agents queue
    label: str
    pool: bool = False  # the server holds the base in a reserved pool slot (agents never run there)

    @property
    def stock(self) -> bool:
        """True for the pristine server."""
        return self.kind is ServerKind.UPSTREAM

    @property
    def unified(self) -> bool:
        """True when the server runs with one unified KV buffer (``-kvu``)."""
        return "-kvu" in self.flags


_UP, _PATCHED = ServerKind.UPSTREAM, ServerKind.PATCHED
SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("stock", _UP, (), False, False, "copies", "stock, its defaults (KV streams)"),
        System("stock_kvu", _UP, ("-kvu",), False, False, "copies", "stock, -kvu"),
        System("stock_cache", _UP, _STOCK_REUSE, False, True, "copies", "stock, host cache + similarity, base first"),
        System("stock_queued", _UP, _STOCK_REUSE, False, True, "shared", "stock at the sharing KV budget, queued"),
        System("patched", _PATCHED, _POOL_SD, True, True, "shared", "polykv, pool shared (-kvu)", pool=True),
        System("copied", _PATCHED, _POOL[1:], True, True, "copies", "polykv without -kvu (pool copied)", pool=True),
        System("dropin", _PATCHED, (*_POOL_SD, "--pool-auto"), False, True, "shared", "polykv drop-in", pool=True),
    )
}
#: ``patched`` with upstream's attention kernel (``--no-shared-decode``): what the decode benchmark
#: (:mod:`bench.decode`) compares ``patched`` with; not part of the stock grids.
UPSTREAM_DECODE = System(
    "patched_upstream_decode",
    _PATCHED,
    (*_POOL, NO_SHARED_DECODE),
    True,
    True,
    "shared",
    "polykv, pool shared, upstream's decode attention",
    pool=True,
)
#: The stock systems, whose fastest per cell is "best stock".
STOCK = tuple(name for name, s in SYSTEMS.items() if s.stock)


def best_stock(walls: dict[str, float | None]) -> tuple[str, float] | None:
    """The fastest stock system of one cell and its wall time (None if no stock system ran)."""
    ran = [(w, name) for name, w in walls.items() if name in STOCK and w is not None]
    if not ran:
        return None
    w, name = min(ran)
    return name, w


def start_system_server(
    system: System,
    slots: int,
    cells: int,
    *,
    model: str | None,
    threads: int,
    name: str,
    save_path: str | None = None,
    extra: Sequence[str] = (),
) -> LlamaServer:
    """A started server for ``system`` with ``slots`` slots and ``cells`` KV cells, logging its KV cells in use
    (``save_path``: its ``--slot-save-path``, else a fresh directory; ``extra``: arguments every system gets alike,
    e.g. ``-ngl 99`` on a GPU)."""
    args = [*slots_args(slots, cells), "--slots", *slot_actions_args(save_path), *system.flags, *extra]
    return custom_server(system.kind, args, model=model, threads=threads, track_kv=True, name=name).start()

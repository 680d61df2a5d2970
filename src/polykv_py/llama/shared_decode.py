"""The CPU backend's shared-prefix decode attention (patch 0076), for in-process contexts.

libggml is one per process: the switch applies to every context of this process (the
patched llama-server sets the same switch from ``--shared-decode``). Off by default; off,
ggml computes what upstream computes. It applies to flash-attention batches of 2-511 tokens
with f16 or q8_0 KV (unified KV lets agents' rows share the prefix cells).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from .._ffi import ffi, lib
from ..errors import LlamaError


@functools.cache
def _entry(name: str, cdecl: str) -> Any:
    """The CPU backend's function ``name`` cast to ``cdecl``, looked up once per process (libggml is loaded
    once and never unloaded, so the pointer stays valid); a build without it raises every time it is asked."""
    reg = lib.ggml_backend_reg_by_name(b"CPU")
    fn = lib.ggml_backend_reg_get_proc_address(reg, name.encode()) if reg != ffi.NULL else ffi.NULL
    if fn == ffi.NULL:
        raise LlamaError(f"the CPU backend has no {name} (a build without patch 0076)")
    return ffi.cast(cdecl, fn)


@dataclass(frozen=True)
class SharedDecodeStats:
    """Counters since the process started: ops computed by the path and its tiles by kind."""

    ops: int
    tiles_shared: int
    tiles_private: int
    tiles_skipped: int


@dataclass(frozen=True)
class SharedDecodeTimes:
    """Where the path's time went since the process started (``polykv-fattn.h``): its nodes' wall time (one thread's
    view, from a node's start to its last row), the threads' time summed by tile kind, the arithmetic of each kind
    (2 (DK + DV) flops per query head and visible (token, cell) pair) and the K/V row bytes of the private pairs."""

    node_ns: int
    shared_ns: int
    private_ns: int
    items_ns: int
    shared_flop: int
    private_flop: int
    private_bytes: int


def set_shared_decode(on: bool) -> None:
    """Turn the path on or off for this process."""
    _entry("ggml_backend_cpu_polykv_set_shared_decode", "void (*)(bool)")(bool(on))


def shared_decode_enabled() -> bool:
    """Whether the path is on."""
    return bool(_entry("ggml_backend_cpu_polykv_get_shared_decode", "bool (*)(void)")())


def shared_decode_stats() -> SharedDecodeStats:
    """The CPU backend's counters of the path."""
    out = ffi.new("uint64_t[4]")
    _entry("ggml_backend_cpu_polykv_shared_decode_stats", "void (*)(uint64_t *)")(out)
    return SharedDecodeStats(*(int(x) for x in out))


def shared_decode_times() -> SharedDecodeTimes:
    """The CPU backend's time and work counters of the path."""
    n = len(dataclasses.fields(SharedDecodeTimes))
    out = ffi.new(f"uint64_t[{n}]")
    _entry("ggml_backend_cpu_polykv_shared_decode_times", "void (*)(uint64_t *)")(out)
    return SharedDecodeTimes(*(int(x) for x in out))

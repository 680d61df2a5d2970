"""Count KV cells in use by parsing libllama's whole-context state blob.

libllama (at the pinned commit) has no public call that reports how many KV cells are
occupied. Its whole-context state (``llama_state_get_data``) lists every occupied cell
exactly once, with its position and the sequence ids that share it, so parsing that
blob gives an exact count. Layout written by ``llama_context::state_write_data`` and
``llama_kv_cache::state_write`` (all little-endian)::

    u32 len, bytes arch                      model architecture name
    then one or more KV caches (iSWA models write two), each:
      u32 n_stream
      per stream: u32 cell_count; if cell_count > 0:
        cell_count x (i32 pos, u32 n_seq_id, [ext], n_seq_id x i32 seq_id)
        u32 v_trans, u32 n_layer
        n_layer x (i32 k_type, u64 k_row, cell_count * k_row bytes)
        v_trans == 0: n_layer x (i32 v_type, u64 v_row, cell_count * v_row bytes)
        v_trans == 1: n_layer x (i32 v_type, u32 v_el, u32 n_embd_v, n_embd_v * cell_count * v_el bytes)

The parser is strict: it must consume the blob exactly, else it raises ``ValueError``
(the caller turns that into a clear error rather than a wrong number).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

#: bytes of ``llama_kv_cell_ext`` (x, y, tok) written per cell by M-RoPE / PLE models.
CELL_EXT_SIZE = 12

_MAX_SEQ = 256


@dataclass
class StreamUsage:
    """Occupied cells of one KV stream."""

    cells: int = 0
    seq_refs: int = 0  # sum over cells of the number of sequences sharing the cell
    per_seq: dict[int, int] = field(default_factory=dict)  # seq id -> cells holding it


@dataclass
class KVUsage:
    """Occupied KV cells of a context, from its state blob."""

    arch: str
    caches: list[list[StreamUsage]]  # per KV cache (1, or 2 for iSWA), per stream
    cell_bytes: int  # K+V bytes of one cell of the first non-empty stream (0 if empty)

    @property
    def cells(self) -> int:
        """Distinct occupied cells, all caches and streams together."""
        return sum(s.cells for cache in self.caches for s in cache)

    @property
    def seq_refs(self) -> int:
        return sum(s.seq_refs for cache in self.caches for s in cache)

    def cells_of(self, seq_id: int) -> int:
        """Cells that hold ``seq_id`` (shared cells count for every sequence sharing them)."""
        return sum(s.per_seq.get(seq_id, 0) for cache in self.caches for s in cache)


class _Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.off = 0

    def take(self, fmt: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        if self.off + size > len(self.buf):
            raise ValueError(f"state blob truncated at offset {self.off}")
        vals = struct.unpack_from(fmt, self.buf, self.off)
        self.off += size
        return vals

    def skip(self, n: int) -> None:
        if n < 0 or self.off + n > len(self.buf):
            raise ValueError(f"state blob truncated at offset {self.off} (skip {n})")
        self.off += n


def _parse_stream(r: _Reader, cell_ext: int) -> tuple[StreamUsage, int]:
    (count,) = r.take("<I")
    usage = StreamUsage(cells=count)
    if count == 0:
        return usage, 0
    for _ in range(count):
        pos, n_seq = r.take("<iI")
        if pos < 0 or n_seq > _MAX_SEQ:
            raise ValueError(f"implausible cell (pos {pos}, {n_seq} sequences)")
        r.skip(cell_ext)
        seqs = r.take(f"<{n_seq}i") if n_seq else ()
        usage.seq_refs += n_seq
        for s in seqs:
            if not 0 <= s < _MAX_SEQ:
                raise ValueError(f"implausible sequence id {s}")
            usage.per_seq[s] = usage.per_seq.get(s, 0) + 1
    v_trans, n_layer = r.take("<II")
    if v_trans > 1 or n_layer > 4096:
        raise ValueError(f"implausible data header (v_trans {v_trans}, n_layer {n_layer})")
    cell_bytes = 0
    for _ in range(n_layer):
        _, k_row = r.take("<iQ")
        r.skip(count * k_row)
        cell_bytes += k_row
    for _ in range(n_layer):
        if v_trans:
            _, v_el, n_embd_v = r.take("<iII")
            r.skip(n_embd_v * count * v_el)
            cell_bytes += n_embd_v * v_el
        else:
            _, v_row = r.take("<iQ")
            r.skip(count * v_row)
            cell_bytes += v_row
    return usage, cell_bytes


def _parse(buf: memoryview, cell_ext: int) -> KVUsage:
    r = _Reader(buf)
    (n,) = r.take("<I")
    if n > 1024:
        raise ValueError("implausible architecture name length")
    arch = bytes(buf[r.off : r.off + n]).decode("utf-8", "replace")
    r.skip(n)
    caches: list[list[StreamUsage]] = []
    cell_bytes = 0
    while r.off < len(buf):
        (n_stream,) = r.take("<I")
        if not 0 < n_stream <= _MAX_SEQ:
            raise ValueError(f"implausible stream count {n_stream}")
        streams = []
        for _ in range(n_stream):
            usage, cb = _parse_stream(r, cell_ext)
            streams.append(usage)
            cell_bytes = cell_bytes or cb
        caches.append(streams)
    if not caches:
        raise ValueError("state blob holds no KV cache")
    return KVUsage(arch=arch, caches=caches, cell_bytes=cell_bytes)


def parse_kv_usage(buf: bytes | memoryview) -> KVUsage:
    """Parse a whole-context state blob; tries the plain cell layout, then the one with cell ext."""
    view = memoryview(buf).cast("B")
    errors = []
    for ext in (0, CELL_EXT_SIZE):
        try:
            return _parse(view, ext)
        except (ValueError, struct.error) as exc:
            errors.append(f"cell ext {ext}: {exc}")
    raise ValueError("cannot parse the context state as KV cache cells (" + "; ".join(errors) + ")")

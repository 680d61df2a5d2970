"""The memory (KV cache) of a context: sequence operations, validated before they reach C.

libllama aborts the process (``GGML_ASSERT``) on a sequence id outside the context's
range and, without unified KV, on a partial-range ``seq_cp`` between sequences (each
sequence has its own stream then). Every such case is refused here with a
:class:`~polykv_py.errors.SequenceError` instead.

It also keeps each sequence's *exactness* (the in-process side of the server's provenance,
``native/server/server-polykv-provenance.h``): cells are exact while each was computed from the
sequence's own tokens at its own position. A shift (``seq_add``) makes the cells from the first
moved position on inexact, and so does removing a middle range or copying a range that does not
start at 0; a raw state load makes the whole sequence unknown. Removing everything from that
position on makes the sequence exact again. :meth:`Memory.exact_len` reads it; the engine shares
and saves only exact cells.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .._ffi import ffi, lib
from ..errors import LlamaError, SequenceError
from ._check import check_nonzero, check_ptr, check_seq_rm
from ._kvstate import KVUsage, parse_kv_usage

if TYPE_CHECKING:
    from .context import Context

log = logging.getLogger(__name__)

_POS_MIN = -(2**31)
_POS_MAX = 2**31 - 1


def _pos(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not _POS_MIN <= value <= _POS_MAX:
        raise SequenceError(f"{name} must be an int32, not {value!r}")
    return value


class Memory:
    """View of a :class:`Context`'s memory; valid while the context is open.

    Ranges follow llama.h: ``[p0, p1)``, a negative ``p0`` means 0 and a negative
    ``p1`` means "to the end".

    It also keeps the record of pending copies: without unified KV, a whole-sequence
    ``seq_cp`` between streams is only carried out by libllama at the next decode, and
    until then the destination's data is not there (:attr:`pending_copies`).
    """

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._pending: set[int] = set()
        self._inexact_from: dict[int, int] = {}  # seq -> first position whose cell is not exact (absent: all exact)

    @property
    def _mem(self) -> Any:
        return check_ptr(lib.llama_get_memory(self._ctx.ptr), "llama_get_memory (the context's memory module)")

    # -- validation -----------------------------------------------------------------
    def check_seq(self, seq_id: int, *, allow_all: bool = False) -> int:
        """Return ``seq_id`` if it is in ``[0, n_seq_max)`` (or -1 when ``allow_all``)."""
        n = self._ctx.n_seq_max
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise SequenceError(f"sequence ids are ints, not {type(seq_id).__name__}")
        if allow_all and seq_id == -1:
            return seq_id
        if not 0 <= seq_id < n:
            raise SequenceError(
                f"sequence id {seq_id} is out of range: this context has n_seq_max={n} (ids 0..{n - 1})"
            )
        return seq_id

    @staticmethod
    def _range(p0: int, p1: int) -> tuple[int, int]:
        p0, p1 = _pos("p0", p0), _pos("p1", p1)
        if p0 >= 0 and p1 >= 0 and p1 < p0:
            raise SequenceError(f"empty or reversed position range [{p0}, {p1})")
        return p0, p1

    # -- operations -----------------------------------------------------------------
    def clear(self, data: bool = True) -> None:
        """Remove every cell of every sequence (``data`` also zeroes the buffers)."""
        lib.llama_memory_clear(self._mem, bool(data))
        self._pending.clear()
        self._inexact_from.clear()

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        """Remove ``seq_id``'s tokens with positions in ``[p0, p1)``; ``seq_id=-1`` means every sequence."""
        self.check_seq(seq_id, allow_all=True)
        p0, p1 = self._range(p0, p1)
        check_seq_rm(bool(lib.llama_memory_seq_rm(self._mem, seq_id, p0, p1)), seq_id, p0, p1)
        seqs = [seq_id] if seq_id != -1 else range(self._ctx.n_seq_max) if p1 >= 0 else list(self._inexact_from)
        for seq in seqs:
            self._after_rm(seq, max(p0, 0), p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` share ``src``'s cells with positions in ``[p0, p1)``.

        Unified KV: adds ``dst`` to the existing cells, no data is copied.
        Non-unified KV: ``src`` and ``dst`` live in different streams; only a whole-sequence
        copy (``p0 < 1`` and ``p1 < 0``) is possible, it *replaces* everything ``dst`` held,
        and the data is copied at the next decode.
        """
        self.check_seq(src)
        self.check_seq(dst)
        p0, p1 = self._range(p0, p1)
        if src == dst:
            return
        if not self._ctx.kv_unified and self._ctx.n_seq_max > 1:
            if p0 > 0 or p1 >= 0:
                raise SequenceError(
                    f"seq_cp({src} -> {dst}, [{p0}, {p1})): without unified KV every sequence has its own "
                    "stream and libllama can only copy a whole sequence between streams (a partial range "
                    "would abort the process); use p0=-1, p1=-1, or a context with kv_unified=True"
                )
            self._pending.add(dst)
            self._inexact_from.pop(dst, None)  # a whole-stream copy replaces what dst held
        lib.llama_memory_seq_cp(self._mem, src, dst, p0, p1)
        # dst's cells are as exact as src's; copied from p0 > 0 on, they were computed over src's cells below p0,
        # which dst may not hold
        self.mark_inexact(dst, self.exact_len(src) if p0 <= 0 else min(self.exact_len(src), p0))

    def seq_keep(self, seq_id: int) -> None:
        """Remove every cell that does not belong to ``seq_id``."""
        self.check_seq(seq_id)
        lib.llama_memory_seq_keep(self._mem, seq_id)
        kept = self._inexact_from.get(seq_id)
        self._inexact_from = {} if kept is None else {seq_id: kept}

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift positions of ``seq_id`` in ``[p0, p1)`` by ``delta`` (RoPE shift at next decode)."""
        self.check_seq(seq_id)
        p0, p1 = self._range(p0, p1)
        _pos("delta", delta)
        if not self.can_shift:
            raise SequenceError("this model's memory does not support position shifts (seq_add)")
        lib.llama_memory_seq_add(self._mem, seq_id, p0, p1, delta)
        if delta != 0:
            self.mark_inexact(seq_id, max(0, min(p0, p0 + delta)))

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id`` in memory, -1 if it is empty."""
        self.check_seq(seq_id)
        return int(lib.llama_memory_seq_pos_min(self._mem, seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id`` in memory, -1 if it is empty."""
        self.check_seq(seq_id)
        return int(lib.llama_memory_seq_pos_max(self._mem, seq_id))

    def seq_pos_range(self, seq_id: int) -> tuple[int, int]:
        """``(seq_pos_min, seq_pos_max)`` of ``seq_id``; ``(-1, -1)`` if it is empty."""
        return self.seq_pos_min(seq_id), self.seq_pos_max(seq_id)

    def seq_len(self, seq_id: int) -> int:
        """Number of positions ``seq_id`` holds (``pos_max - pos_min + 1``, 0 if empty)."""
        lo, hi = self.seq_pos_range(seq_id)
        return 0 if hi < 0 else hi - lo + 1

    @property
    def can_shift(self) -> bool:
        return bool(lib.llama_memory_can_shift(self._mem))

    # -- exactness ------------------------------------------------------------------
    def exact_len(self, seq_id: int) -> int:
        """How many leading positions of ``seq_id`` hold exact cells (computed from the sequence's own
        tokens at their own positions); a large number (2**31 - 1) when nothing was ever moved."""
        self.check_seq(seq_id)
        return self._inexact_from.get(seq_id, _POS_MAX)

    def mark_inexact(self, seq_id: int, pos: int) -> None:
        """Record that ``seq_id``'s cells from ``pos`` on are not exact (0: the whole sequence is unknown)."""
        self.check_seq(seq_id)
        if pos < _POS_MAX:
            self._inexact_from[seq_id] = min(self._inexact_from.get(seq_id, _POS_MAX), max(pos, 0))

    def mark_exact(self, seq_id: int) -> None:
        """Record that ``seq_id`` holds exact cells only (a verified prefix file was just loaded into it)."""
        self.check_seq(seq_id)
        self._inexact_from.pop(seq_id, None)

    def _after_rm(self, seq_id: int, p0: int, p1: int) -> None:
        if seq_id not in self._inexact_from:
            if p1 >= 0 and self.seq_pos_max(seq_id) >= p1:
                self._inexact_from[seq_id] = p0  # a hole: the cells after it were computed over removed ones
            return
        if p1 < 0 and p0 <= self._inexact_from[seq_id]:
            del self._inexact_from[seq_id]  # every inexact cell is gone
        elif p1 >= 0 and self.seq_pos_max(seq_id) >= p1:
            self._inexact_from[seq_id] = min(self._inexact_from[seq_id], p0)

    # -- pending cross-stream copies ------------------------------------------------
    @property
    def pending_copies(self) -> frozenset[int]:
        """Sequences whose cross-stream copy libllama carries out at the next decode."""
        return frozenset(self._pending)

    def on_decode(self) -> None:
        """Record a successful decode (:meth:`Context.decode` calls this): the copies are done."""
        self._pending.clear()

    # -- measurement ----------------------------------------------------------------
    def usage(self) -> KVUsage:
        """Occupied KV cells, parsed from the whole-context state (see :mod:`._kvstate`).

        Cost: one copy of the occupied KV data into host memory; meant for tests and
        benchmarks, not hot loops.
        """
        ctx = self._ctx.ptr
        if self._pending:
            raise LlamaError("a cross-stream seq_cp is pending until the next decode; decode before measuring")
        size = int(lib.llama_state_get_size(ctx))
        buf = ffi.new("uint8_t[]", max(1, size))
        n = check_nonzero(
            int(lib.llama_state_get_data(ctx, buf, size)), "llama_state_get_data (measuring KV cells)", at_most=size
        )
        try:
            return parse_kv_usage(ffi.buffer(buf, n))
        except ValueError as exc:
            raise LlamaError(f"cannot count KV cells for this memory type: {exc}") from exc

    def cells_in_use(self) -> int:
        """Distinct occupied KV cells (a cell shared by several sequences counts once)."""
        return self.usage().cells

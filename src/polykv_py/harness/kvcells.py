"""KV cells in use, read from a llama-server log.

llama.cpp has no endpoint or metric for the number of KV cells in use, but its KV
cache prints ``find_slot: stream[S], n = ..., used = U, ...`` before every
micro-batch when the process runs with ``LLAMA_KV_CACHE_DEBUG=1`` and the server
logs at debug verbosity (``-lv 5``).  ``used`` is ``llama_kv_cells::get_used()``:
cells that belong to at least one sequence, so a cell shared by N sequences counts
once.  The reading is taken *before* each micro-batch is placed, so a peak is
exact up to the last micro-batch (at most one token per sequence during generation).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: How the numbers are obtained, for reports.
KV_METHOD = "llama-server log with LLAMA_KV_CACHE_DEBUG=1 -lv 5: peak of find_slot 'used' (cells with >= 1 sequence)"

_LINE = re.compile(rb"find_slot: stream\[(\d+)\], n = *(\d+), used = *(\d+)")
#: Log lines that mean the server ran out of KV room: an idle slot's cache was dropped, or a decode failed.
EVICTION_MARKERS = (b"purging slot", b"failed to find free space in the KV cache", b"failed to decode")


@dataclass(frozen=True)
class KVReading:
    """Cells in use over a stretch of log: the peak, the last value, the number of samples,
    and how many lines reported an eviction or a full KV cache (:data:`EVICTION_MARKERS`)."""

    peak: int
    last: int
    samples: int
    evictions: int = 0


def parse_used(lines: Iterable[bytes], start: dict[int, int] | None = None) -> tuple[KVReading, dict[int, int]]:
    """Fold ``find_slot`` lines into a reading; ``start`` is the per-stream state before them.

    Returns the reading (cells summed over streams) and the per-stream state after them.
    """
    state = dict(start or {})
    peak = last = sum(state.values())
    samples = evictions = 0
    for line in lines:
        m = _LINE.search(line)
        if m is None:
            if any(marker in line for marker in EVICTION_MARKERS):
                evictions += 1
            continue
        state[int(m.group(1))] = int(m.group(3))
        last = sum(state.values())
        peak = max(peak, last)
        samples += 1
    return KVReading(peak=peak, last=last, samples=samples, evictions=evictions), state


class KVCellsLog:
    """Follows a server log file and reports KV cells in use between two points."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offset = 0
        self._state: dict[int, int] = {}

    def mark(self) -> None:
        """Start a new window here (consumes what the log holds so far)."""
        self.read()

    def read(self) -> KVReading:
        """Cells in use since the last :meth:`mark` / :meth:`read`."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return KVReading(0, 0, 0)
        end = data.rfind(b"\n") + 1  # a half-written last line is read next time
        reading, self._state = parse_used(data[:end].splitlines(), self._state)
        self._offset += end
        return reading

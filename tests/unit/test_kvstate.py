"""The KV-cell counter parses libllama's state layout exactly (synthetic blobs, no native code)."""

from __future__ import annotations

import struct

import pytest

from polykv_py.llama._kvstate import CELL_EXT_SIZE, parse_kv_usage

N_LAYER = 2
K_ROW = 8
V_ROW = 6


def _stream(cells: list[tuple[int, list[int]]], *, v_trans: bool = False, ext: int = 0) -> bytes:
    out = struct.pack("<I", len(cells))
    if not cells:
        return out
    for pos, seqs in cells:
        out += struct.pack("<iI", pos, len(seqs)) + b"\x00" * ext + struct.pack(f"<{len(seqs)}i", *seqs)
    n = len(cells)
    out += struct.pack("<II", int(v_trans), N_LAYER)
    for _ in range(N_LAYER):
        out += struct.pack("<iQ", 1, K_ROW) + b"k" * (n * K_ROW)
    for _ in range(N_LAYER):
        if v_trans:
            out += struct.pack("<iII", 1, 2, 3) + b"v" * (3 * n * 2)
        else:
            out += struct.pack("<iQ", 1, V_ROW) + b"v" * (n * V_ROW)
    return out


def _blob(*caches: list[bytes]) -> bytes:
    arch = b"llama"
    out = struct.pack("<I", len(arch)) + arch
    for streams in caches:
        out += struct.pack("<I", len(streams)) + b"".join(streams)
    return out


def test_empty_context() -> None:
    u = parse_kv_usage(_blob([_stream([])]))
    assert u.arch == "llama" and u.cells == 0 and u.seq_refs == 0 and u.cell_bytes == 0


def test_shared_cells_count_once() -> None:
    prefix = [(p, [0, 1, 2]) for p in range(5)]
    suffixes = [(5, [1]), (6, [1]), (5, [2])]
    u = parse_kv_usage(_blob([_stream(prefix + suffixes)]))
    assert u.cells == 8
    assert u.seq_refs == 15 + 3
    assert (u.cells_of(0), u.cells_of(1), u.cells_of(2)) == (5, 7, 6)
    assert u.cell_bytes == N_LAYER * (K_ROW + V_ROW)


def test_transposed_v_and_multiple_streams() -> None:
    s0 = _stream([(0, [0]), (1, [0])], v_trans=True)
    s1 = _stream([(0, [1])], v_trans=True)
    u = parse_kv_usage(_blob([s0, s1, _stream([])]))
    assert u.cells == 3 and len(u.caches[0]) == 3
    assert u.cell_bytes == N_LAYER * (K_ROW + 3 * 2)


def test_two_caches_iswa() -> None:
    u = parse_kv_usage(_blob([_stream([(0, [0])])], [_stream([(0, [0]), (1, [0])])]))
    assert len(u.caches) == 2 and u.cells == 3


def test_cell_ext_layout_is_recognised() -> None:
    u = parse_kv_usage(_blob([_stream([(0, [0]), (1, [0])], ext=CELL_EXT_SIZE)]))
    assert u.cells == 2


@pytest.mark.parametrize("cut", [1, 7, 40])
def test_truncated_or_padded_blob_is_refused(cut: int) -> None:
    blob = _blob([_stream([(0, [0]), (1, [0, 1])])])
    with pytest.raises(ValueError, match="cannot parse"):
        parse_kv_usage(blob[:-cut])
    with pytest.raises(ValueError, match="cannot parse"):
        parse_kv_usage(blob + b"\x00" * cut)

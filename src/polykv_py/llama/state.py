"""Sequence state save/load: raw libllama bytes and files, and a verified prefix file.

The raw calls (``llama_state_seq_*``) trust the caller: a state saved from another
model with the same tensor shapes loads silently, and the llama file format stores the
tokens but nothing about the model. :func:`save_prefix` / :func:`load_prefix` wrap the
raw bytes in a small container that records the model's fingerprint (GGUF sha256 and
shape), the token list and a hash of the state, and refuse anything that does not match.

Container layout: ``MAGIC`` (8 bytes), u32 header length, UTF-8 JSON header, state bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._ffi import ffi, lib
from ..errors import ContextFullError, StateError, TokenError
from ._check import check_nonzero

if TYPE_CHECKING:
    from .context import Context

MAGIC = b"PKVPFX\x00\x01"
FORMAT_VERSION = 1


def _tokens_sha256(tokens: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest()


def _check_ready(ctx: Context, seq_id: int) -> None:
    ctx.memory.check_seq(seq_id)
    if seq_id in ctx._pending_copies:
        raise StateError(f"sequence {seq_id} has a pending cross-stream copy; decode once before saving it")


# -- raw libllama state ---------------------------------------------------------------
def seq_state_bytes(ctx: Context, seq_id: int) -> bytes:
    """The state of one sequence as bytes (``llama_state_seq_get_data``)."""
    _check_ready(ctx, seq_id)
    size = int(lib.llama_state_seq_get_size(ctx.ptr, seq_id))
    check_nonzero(size, f"llama_state_seq_get_size(seq {seq_id})", StateError)
    buf = ffi.new("uint8_t[]", size)
    n = int(lib.llama_state_seq_get_data(ctx.ptr, buf, size, seq_id))
    check_nonzero(n, f"llama_state_seq_get_data(seq {seq_id})", StateError)
    return ffi.buffer(buf, n)[:]


def set_seq_state_bytes(ctx: Context, data: bytes, seq_id: int) -> int:
    """Load bytes from :func:`seq_state_bytes` into ``seq_id`` (its old cells are removed first)."""
    ctx.memory.check_seq(seq_id)
    if not data:
        raise StateError("empty sequence state")
    ctx.memory.seq_rm(seq_id)
    n = int(lib.llama_state_seq_set_data(ctx.ptr, data, len(data), seq_id))
    what = (
        f"llama_state_seq_set_data(seq {seq_id}) (not a state, another KV stream layout or tensor shape, "
        "or not enough free KV cells)"
    )
    return check_nonzero(n, what, StateError)


def save_seq_file(ctx: Context, path: str | os.PathLike[str], seq_id: int, tokens: Sequence[int]) -> int:
    """``llama_state_seq_save_file``: the sequence's state plus its token list; returns bytes written."""
    _check_ready(ctx, seq_id)
    toks = ctx.model.vocab.check_tokens(tokens)
    arr = ffi.new("llama_token[]", toks) if toks else ffi.NULL
    n = int(lib.llama_state_seq_save_file(ctx.ptr, os.fsencode(path), seq_id, arr, len(toks)))
    return check_nonzero(n, f"llama_state_seq_save_file({path})", StateError)


def load_seq_file(ctx: Context, path: str | os.PathLike[str], seq_id: int) -> list[int]:
    """``llama_state_seq_load_file`` into ``seq_id``; returns the token list stored with it."""
    ctx.memory.check_seq(seq_id)
    p = os.fsencode(path)
    if not os.path.isfile(path):
        raise StateError(f"no such state file: {os.fsdecode(p)}")
    count = ffi.new("size_t *")
    lib.llama_state_seq_load_file(ctx.ptr, p, seq_id, ffi.NULL, 0, count)  # token count only
    cap = max(1, int(count[0]))
    toks = ffi.new("llama_token[]", cap)
    ctx.memory.seq_rm(seq_id)
    n = int(lib.llama_state_seq_load_file(ctx.ptr, p, seq_id, toks, cap, count))
    check_nonzero(n, f"llama_state_seq_load_file({os.fsdecode(p)})", StateError)
    return list(ffi.unpack(toks, int(count[0])))


# -- verified prefix container --------------------------------------------------------
def save_prefix(ctx: Context, path: str | os.PathLike[str], seq_id: int, tokens: Sequence[int]) -> Path:
    """Save sequence ``seq_id`` (which must hold exactly ``tokens`` at positions 0..n-1) to ``path``."""
    toks = ctx.model.vocab.check_tokens(tokens)
    if not toks:
        raise StateError("cannot save an empty prefix")
    lo, hi = ctx.memory.seq_pos_min(seq_id), ctx.memory.seq_pos_max(seq_id)
    if (lo, hi) != (0, len(toks) - 1):
        raise StateError(
            f"sequence {seq_id} holds positions [{lo}, {hi}], not the {len(toks)} tokens given ([0, {len(toks) - 1}])"
        )
    state = seq_state_bytes(ctx, seq_id)
    header = {
        "format": FORMAT_VERSION,
        "model": ctx.model.fingerprint(),
        "n_tokens": len(toks),
        "tokens_sha256": _tokens_sha256(toks),
        "tokens": toks,
        "n_stream": ctx.n_stream,
        "state_bytes": len(state),
        "state_sha256": hashlib.sha256(state).hexdigest(),
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    out = Path(path)
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(raw)) + raw)
        f.write(state)
    tmp.replace(out)
    return out


def read_prefix_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a prefix file (raises :class:`StateError` if it is not one)."""
    return _read_header(path)[0]


def _read_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 4)
            if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
                raise StateError(f"{path} is not a polykv prefix file (bad magic)")
            (n,) = struct.unpack("<I", head[len(MAGIC) :])
            header = json.loads(f.read(n))
    except OSError as exc:
        raise StateError(f"cannot read prefix file {path}: {exc}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise StateError(f"{path}: corrupt prefix header ({exc})") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        fmt = header.get("format") if isinstance(header, dict) else "?"
        raise StateError(f"{path}: unsupported prefix file format {fmt}")
    return header, len(MAGIC) + 4 + n


def load_prefix(
    ctx: Context, path: str | os.PathLike[str], seq_id: int, expected_tokens: Sequence[int] | None = None
) -> list[int]:
    """Load a prefix saved by :func:`save_prefix` into ``seq_id``; returns its tokens.

    Refuses (``StateError``) a file from another model, another token list than
    ``expected_tokens``, another stream layout, or with a damaged state.
    """
    ctx.memory.check_seq(seq_id)
    header, offset = _read_header(path)
    mine = ctx.model.fingerprint()
    theirs = header.get("model")
    if not isinstance(theirs, dict):
        raise StateError(f"{path}: the header names no model")
    if theirs != mine:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise StateError(f"{path} was saved from another model (differs in {', '.join(diff)})")
    tokens = header.get("tokens")
    if (
        not isinstance(tokens, list)
        or len(tokens) != header.get("n_tokens")
        or _tokens_sha256(tokens) != header.get("tokens_sha256")
    ):
        raise StateError(f"{path}: token list damaged")
    try:
        ctx.model.vocab.check_tokens(tokens)
    except TokenError as exc:
        raise StateError(f"{path}: {exc}") from exc
    if expected_tokens is not None:
        exp = list(expected_tokens)
        if exp != tokens:
            first = next((i for i, (a, b) in enumerate(zip(exp, tokens)) if a != b), min(len(exp), len(tokens)))
            raise StateError(
                f"{path} holds another token list ({len(tokens)} tokens, expected {len(exp)}; first difference at {first})"
            )
    if header.get("n_stream") != ctx.n_stream:
        raise StateError(
            f"{path} was saved from a context with {header.get('n_stream')} KV stream(s), this one has {ctx.n_stream} "
            "(unified vs non-unified KV, or a different n_seq_max without unified KV)"
        )
    if len(tokens) > ctx.n_ctx_seq:
        raise ContextFullError(f"the prefix has {len(tokens)} tokens but a sequence holds at most {ctx.n_ctx_seq}")
    with open(path, "rb") as f:
        f.seek(offset)
        state = f.read()
    if len(state) != header.get("state_bytes") or hashlib.sha256(state).hexdigest() != header.get("state_sha256"):
        raise StateError(f"{path}: state data damaged (size or sha256 mismatch)")
    set_seq_state_bytes(ctx, state, seq_id)
    lo, hi = ctx.memory.seq_pos_min(seq_id), ctx.memory.seq_pos_max(seq_id)
    if (lo, hi) != (0, len(tokens) - 1):
        ctx.memory.seq_rm(seq_id)
        raise StateError(f"{path}: loaded sequence holds positions [{lo}, {hi}], expected [0, {len(tokens) - 1}]")
    return tokens

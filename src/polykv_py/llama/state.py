"""The verified prefix file: its container format, written and checked without native code.

The raw sequence-state calls (:meth:`Context.seq_state_bytes` and the other
``llama_state_seq_*`` wrappers) trust the caller: a state saved from another model with
the same tensor shapes loads silently, and the llama file format stores the tokens but
nothing about the model. :meth:`Context.save_prefix` / :meth:`Context.load_prefix` wrap
the raw bytes in this small container, which records the model's fingerprint (GGUF sha256
and shape), the token list and a hash of the state, and refuse anything that does not match.

Container layout: ``MAGIC`` (8 bytes), u32 header length, UTF-8 JSON header, state bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ContextFullError, StateError, TokenError

MAGIC = b"PKVPFX\x00\x01"
FORMAT_VERSION = 1


def tokens_sha256(tokens: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest()


def write_prefix_file(
    path: str | os.PathLike[str], state: bytes, *, model: Mapping[str, Any], tokens: list[int], n_stream: int
) -> Path:
    """Write ``state`` (the sequence's raw bytes) with its header; atomic (a ``.part`` file, renamed)."""
    header = {
        "format": FORMAT_VERSION,
        "model": dict(model),
        "n_tokens": len(tokens),
        "tokens_sha256": tokens_sha256(tokens),
        "tokens": tokens,
        "n_stream": n_stream,
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


def read_prefix_file(
    path: str | os.PathLike[str],
    *,
    model: Mapping[str, Any],
    n_stream: int,
    n_ctx_seq: int,
    check_tokens: Callable[[list[int]], object],
    expected_tokens: Sequence[int] | None = None,
) -> tuple[list[int], bytes]:
    """Read a prefix file for a context with ``n_stream`` KV streams on the model ``model``
    (its fingerprint); returns ``(tokens, state)``.

    Refuses (``StateError``) a file from another model, with another token list than
    ``expected_tokens`` or tokens ``check_tokens`` rejects, another stream layout, or a
    damaged state; ``ContextFullError`` if the prefix is longer than ``n_ctx_seq``.
    """
    header, offset = _read_header(path)
    mine, theirs = dict(model), header.get("model")
    if not isinstance(theirs, dict):
        raise StateError(f"{path}: the header names no model")
    if theirs != mine:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise StateError(f"{path} was saved from another model (differs in {', '.join(diff)})")
    tokens = header.get("tokens")
    if (
        not isinstance(tokens, list)
        or len(tokens) != header.get("n_tokens")
        or tokens_sha256(tokens) != header.get("tokens_sha256")
    ):
        raise StateError(f"{path}: token list damaged")
    try:
        check_tokens(tokens)
    except TokenError as exc:
        raise StateError(f"{path}: {exc}") from exc
    if expected_tokens is not None:
        exp = list(expected_tokens)
        if exp != tokens:
            pairs = enumerate(zip(exp, tokens, strict=False))
            first = next((i for i, (a, b) in pairs if a != b), min(len(exp), len(tokens)))
            raise StateError(
                f"{path} holds another token list ({len(tokens)} tokens, expected {len(exp)}; "
                f"first difference at {first})"
            )
    if header.get("n_stream") != n_stream:
        raise StateError(
            f"{path} was saved from a context with {header.get('n_stream')} KV stream(s), this one has {n_stream} "
            "(unified vs non-unified KV, or a different n_seq_max without unified KV)"
        )
    if len(tokens) > n_ctx_seq:
        raise ContextFullError(f"the prefix has {len(tokens)} tokens but a sequence holds at most {n_ctx_seq}")
    with open(path, "rb") as f:
        f.seek(offset)
        state = f.read()
    if len(state) != header.get("state_bytes") or hashlib.sha256(state).hexdigest() != header.get("state_sha256"):
        raise StateError(f"{path}: state data damaged (size or sha256 mismatch)")
    return tokens, state

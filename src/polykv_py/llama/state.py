"""The verified prefix file: its container format, written and checked without native code.

The raw sequence-state calls (:meth:`Context.seq_state_bytes` and the other
``llama_state_seq_*`` wrappers) trust the caller: a state saved from another model with
the same tensor shapes loads silently, and the llama file format stores the tokens but
nothing about the model. :meth:`Context.save_prefix` / :meth:`Context.load_prefix` wrap
the raw bytes in this small container, which records the model's fingerprint (GGUF sha256
and shape), the KV layout, the token list and a hash of the state, and refuse anything that
does not match.

Container layout: ``MAGIC`` (8 bytes), u32 little-endian header length, UTF-8 JSON header,
state bytes. The patched llama-server writes and reads the same container for its reserved
pools (``/slots/N?action=save|restore``, ``tools/server/server-polykv-files.cpp``), so a
prefix saved by either restores into the other. Format 2 (written by both) adds to format 1
(read by the engine only) the KV layout (``kv``: streams, K and V types) and the sha256 of the
pool's ``cache_salt`` (``salt_sha256``, null when unsalted; the engine has no salts), and checks
the state with a CRC-32 (``state_crc32``, zlib's) instead of a sha256: it catches truncation and
damage at memory speed (nothing here is keyed, so a hash would not stop a forger either).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ContextFullError, StateError, TokenError

MAGIC = b"PKVPFX\x00\x01"
FORMAT_VERSION = 2
#: Formats this module reads (1: written before the KV layout and salt were recorded).
READ_FORMATS = (1, 2)


def tokens_sha256(tokens: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest()


def write_prefix_file(
    path: str | os.PathLike[str], state: bytes, *, model: Mapping[str, Any], tokens: list[int], kv: Mapping[str, Any]
) -> Path:
    """Write ``state`` (the sequence's raw bytes) with its header; atomic (a ``.part.<pid>`` file,
    flushed to disk, renamed over ``path``)."""
    header = {
        "format": FORMAT_VERSION,
        "model": dict(model),
        "kv": dict(kv),
        "n_tokens": len(tokens),
        "tokens_sha256": tokens_sha256(tokens),
        "tokens": tokens,
        "salt_sha256": None,
        "state_bytes": len(state),
        "state_crc32": zlib.crc32(state),
        "created_by": "polykv engine",
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    out = Path(path)
    tmp = out.with_name(f"{out.name}.part.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(raw)) + raw)
            f.write(state)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _state_ok(header: dict[str, Any], state: bytes) -> bool:
    """The state's checksum: CRC-32 in format 2 (a state is tens of MB: a restore must not spend longer hashing
    it than loading it), sha256 in format 1."""
    if header["format"] == 1:
        return hashlib.sha256(state).hexdigest() == header.get("state_sha256")
    return zlib.crc32(state) == header.get("state_crc32")


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
    if not isinstance(header, dict) or header.get("format") not in READ_FORMATS:
        fmt = header.get("format") if isinstance(header, dict) else "?"
        raise StateError(f"{path}: unsupported prefix file format {fmt}")
    return header, len(MAGIC) + 4 + n


def read_prefix_file(
    path: str | os.PathLike[str],
    *,
    model: Mapping[str, Any],
    kv: Mapping[str, Any],
    n_ctx_seq: int,
    check_tokens: Callable[[list[int]], object],
    expected_tokens: Sequence[int] | None = None,
) -> tuple[list[int], bytes]:
    """Read a prefix file for a context with the KV layout ``kv`` (``n_stream``, ``type_k``,
    ``type_v``) on the model ``model`` (its fingerprint); returns ``(tokens, state)``.

    Refuses (``StateError``) a file from another model, with another token list than
    ``expected_tokens`` or tokens ``check_tokens`` rejects, another KV layout, a salted pool
    (saved by the server under a ``cache_salt``), or a damaged state; ``ContextFullError`` if
    the prefix is longer than ``n_ctx_seq``.
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
    theirs_kv = header.get("kv", {"n_stream": header.get("n_stream")}) if header["format"] == 1 else header.get("kv")
    mine_kv = dict(kv) if header["format"] != 1 else {"n_stream": kv["n_stream"]}
    if not isinstance(theirs_kv, dict) or theirs_kv != mine_kv:
        n_theirs = theirs_kv.get("n_stream") if isinstance(theirs_kv, dict) else "?"
        raise StateError(
            f"{path} was saved with another KV layout ({theirs_kv}, here {mine_kv}"
            + (
                f"; {n_theirs} KV stream(s) vs {kv['n_stream']}: unified vs non-unified KV, "
                "or a different n_seq_max without unified KV)"
                if n_theirs != kv["n_stream"]
                else ")"
            )
        )
    if header.get("salt_sha256") is not None:
        raise StateError(f"{path} holds a pool saved under a cache_salt; the engine has no salts")
    if len(tokens) > n_ctx_seq:
        raise ContextFullError(f"the prefix has {len(tokens)} tokens but a sequence holds at most {n_ctx_seq}")
    with open(path, "rb") as f:
        f.seek(offset)
        state = f.read()
    if len(state) != header.get("state_bytes") or not _state_ok(header, state):
        raise StateError(f"{path}: state data damaged (size or checksum mismatch)")
    return tokens, state

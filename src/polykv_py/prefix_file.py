"""The verified prefix file: its container format, written and checked without native code.

The raw sequence-state calls (:meth:`Context.seq_state_bytes` and the other
``llama_state_seq_*`` wrappers) trust the caller: a state saved from another model with
the same tensor shapes loads silently, and the llama file format stores the tokens but
nothing about the model. :meth:`Context.save_prefix` / :meth:`Context.load_prefix` wrap
the raw bytes in this small container, which records the model's fingerprint (GGUF sha256
and shape), the KV layout, the token list and a hash of the state, and refuse anything that
does not match.

Container layout (format 3): ``MAGIC`` (8 bytes), u32 little-endian header length, UTF-8 JSON
header, state bytes, then a 32-byte HMAC-SHA256 of everything before it. The patched llama-server
writes and reads the same container for its reserved pools (``/slots/N?action=save|restore``,
``native/server/server-polykv-files.cpp``), so a prefix saved by either restores into the other.

The MAC is keyed with the directory's secret, :data:`KEY_FILE` (32 random bytes, mode 0600,
created by whichever of the engine or the server needs it first): a file someone else wrote into
the directory, or changed, is refused before any of it is read. The directory must belong to this
user and be writable by no one else, and so must the key; neither a file nor the key is opened
through a symbolic link, and a save creates its ``.part.<pid>`` file exclusively. The header
records the model's fingerprint, the KV layout (``kv``), the server's KV settings (``settings``:
RoPE/YaRN, ``--override-kv``, control vectors; ``{}`` here, the engine has none), the tokens, a
keyed MAC of the pool's ``cache_salt`` (``salt_mac``, null when unsalted: the engine has no salts)
and the state's size. Formats 1 and 2 (unauthenticated) are refused: a pool is computed again.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import ContextFullError, StateError, TokenError

MAGIC = b"PKVPFX\x00\x01"
FORMAT_VERSION = 3
#: Formats this module reads (1 and 2 had no MAC: anyone who could write the directory could plant KV).
READ_FORMATS = (3,)
#: The secret that authenticates the pool files of a directory (the server uses the same file).
KEY_FILE = ".polykv-pool.key"
KEY_BYTES = 32
MAC_BYTES = 32
#: The longest header read (the server's cap too): the token list as JSON, ~20M tokens.
MAX_HEADER = 256 << 20


def tokens_sha256(tokens: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest()


def check_pool_dir(directory: str | os.PathLike[str]) -> None:
    """Refuse (``StateError``) a pool directory that is a link, not this user's, or writable by group or others."""
    try:
        st = os.lstat(os.fspath(directory).rstrip("/") or "/")  # lstat("link/") would follow the link
    except OSError as exc:
        raise StateError(f"cannot stat the pool directory {directory}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise StateError(f"the pool directory {directory} is not a directory (a symbolic link is refused)")
    if st.st_uid != os.geteuid():
        raise StateError(
            f"the pool directory {directory} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateError(
            f"the pool directory {directory} is writable by its group or by others "
            f"(mode {stat.S_IMODE(st.st_mode):03o}): chmod go-w it"
        )


def pool_key(directory: str | os.PathLike[str], *, create: bool = True) -> bytes:
    """The directory's secret (:data:`KEY_FILE`), created (0600) if missing and ``create``."""
    check_pool_dir(directory)
    path = Path(directory) / KEY_FILE
    for _ in range(2):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                raise StateError(
                    f"{directory} has no pool key ({KEY_FILE}): no file there was written by polykv"
                ) from None
        except OSError as exc:
            raise StateError(f"cannot read the pool key {path}: {exc}") from exc
        else:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                key = f.read(KEY_BYTES + 1)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or len(key) != KEY_BYTES:
                raise StateError(f"the pool key {path} must be a {KEY_BYTES}-byte file of this user with mode 0600")
            return key
        key = os.urandom(KEY_BYTES)
        # written whole to a file of its own, then linked into place: link fails if the key exists, so a reader
        # never sees a half-written key and two processes creating it at once agree on one
        tmp = path.with_name(f"{KEY_FILE}.new.{os.getpid()}.{os.urandom(4).hex()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)
        except FileExistsError:
            continue  # created meanwhile: read that one
        except OSError as exc:
            raise StateError(f"cannot create the pool key {path}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        return key
    raise StateError(f"cannot create the pool key {path}")


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def write_prefix_file(
    path: str | os.PathLike[str], state: bytes, *, model: Mapping[str, Any], tokens: list[int], kv: Mapping[str, Any]
) -> Path:
    """Write ``state`` (the sequence's raw bytes) with its header and MAC; atomic (a ``.part.<pid>`` file created
    exclusively, flushed to disk, renamed over ``path``)."""
    out = Path(path)
    key = pool_key(out.parent)
    header = {
        "format": FORMAT_VERSION,
        "model": dict(model),
        "kv": dict(kv),
        "settings": {},
        "n_tokens": len(tokens),
        "tokens_sha256": tokens_sha256(tokens),
        "tokens": tokens,
        "salt_mac": None,
        "state_bytes": len(state),
        "mac": "hmac-sha256",
        "created_by": "polykv engine",
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    head = MAGIC + struct.pack("<I", len(raw)) + raw
    tag = _mac(key, head, state)
    tmp = out.with_name(f"{out.name}.part.{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a leftover of this pid; unlink never follows a link
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(state)
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(out)
    except OSError as exc:
        raise StateError(f"cannot write {out}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return out


def read_prefix_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a prefix file (raises :class:`StateError` if it is not one)."""
    return _read_header(path)[0]


def _read_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """The header (not authenticated: for listings; :func:`read_prefix_file` checks the MAC first)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 4)
            if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
                raise StateError(f"{path} is not a polykv prefix file (bad magic)")
            (n,) = struct.unpack("<I", head[len(MAGIC) :])
            if n > MAX_HEADER:
                raise StateError(f"{path}: damaged file (header length {n} beyond {MAX_HEADER})")
            raw = f.read(n)
    except OSError as exc:
        raise StateError(f"cannot read prefix file {path}: {exc}") from exc
    return _decode_header(path, raw), len(MAGIC) + 4 + n


def _decode_header(path: str | os.PathLike[str], raw: bytes) -> dict[str, Any]:
    """The JSON header of a readable format, or :class:`StateError`."""
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise StateError(f"{path}: corrupt prefix header ({type(exc).__name__})") from exc
    if not isinstance(header, dict) or header.get("format") not in READ_FORMATS:
        fmt = header.get("format") if isinstance(header, dict) else "?"
        raise StateError(f"{path}: unsupported prefix file format {fmt} (this version reads {READ_FORMATS})")
    return header


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

    Refuses (``StateError``) a file the directory's key did not authenticate (written by someone
    else, or changed), a file from another model, with another token list than
    ``expected_tokens`` or tokens ``check_tokens`` rejects, another KV layout or KV settings, a
    salted pool (saved by the server under a ``cache_salt``), or a damaged state;
    ``ContextFullError`` if the prefix is longer than ``n_ctx_seq``.
    """
    header, state = read_verified(path)
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
    theirs_kv = header.get("kv")
    mine_kv = dict(kv)
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
    if header.get("settings") != {}:
        raise StateError(f"{path} was saved under KV settings the engine does not use ({header.get('settings')})")
    if header.get("salt_mac") is not None:
        raise StateError(f"{path} holds a pool saved under a cache_salt; the engine has no salts")
    if len(tokens) > n_ctx_seq:
        raise ContextFullError(f"the prefix has {len(tokens)} tokens but a sequence holds at most {n_ctx_seq}")
    if len(state) != header.get("state_bytes"):
        raise StateError(f"{path}: state data damaged (size mismatch)")
    return tokens, state


def read_verified(path: str | os.PathLike[str]) -> tuple[dict[str, Any], bytes]:
    """(header, state) of a file whose MAC the directory's key verifies; nothing is parsed before."""
    p = Path(path)
    key = pool_key(p.parent, create=False)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise StateError(f"cannot read prefix file {path}: {exc}") from exc
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise StateError(f"{path} is not a regular file")
        raw = f.read()
    if raw[: len(MAGIC)] != MAGIC or len(raw) < len(MAGIC) + 4:
        raise StateError(f"{path} is not a polykv prefix file (bad magic)")
    if len(raw) < len(MAGIC) + 4 + MAC_BYTES or not hmac.compare_digest(_mac(key, raw[:-MAC_BYTES]), raw[-MAC_BYTES:]):
        raise StateError(
            f"{path}: authentication failed (not written with this directory's pool key, or changed since)"
        )
    (n,) = struct.unpack("<I", raw[len(MAGIC) : len(MAGIC) + 4])
    offset = len(MAGIC) + 4 + n
    if n > MAX_HEADER or offset > len(raw) - MAC_BYTES:
        raise StateError(f"{path}: damaged file (header length beyond the file)")
    return _decode_header(path, raw[len(MAGIC) + 4 : offset]), raw[offset:-MAC_BYTES]

"""Pool files: a reserved pool's KV saved once and restored after a restart, and the cache that keeps them.

The patched server (patch 0075) saves a reserved pool with ``POST /slots/N?action=save`` and
restores one with ``?action=restore`` into files under its ``--slot-save-path``, in the verified
container of :mod:`polykv_py.prefix_file` (the in-process engine reads and writes the same
files). A restore is checked against the model (GGUF sha256 and shape), the KV layout, the
tokens the caller expects and the pool's ``cache_salt`` before the pool is touched, and is
refused with HTTP 400 otherwise.

This module has the requests, the pool states ``/slots`` reports (:class:`PoolState`: a salted
pool shows only a MAC of its tokens keyed with the salt, so only a holder of the salt can tell
what it holds), the file names (a hash of the model's identity, the KV layout, the tokens and
the salt: never user text) and :class:`PoolCache`, a directory of pool files with a size limit
(partial files of killed saves go first, then the least recently used files) that
``polykv run``, ``polykv serve`` and the fan-out API share.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .cache import cache_dir
from .errors import HTTPError, StateError
from .jsontypes import Json
from .prefix_file import read_prefix_header, tokens_sha256

log = logging.getLogger(__name__)


#: Suffix of the files :func:`pool_file_name` names.
POOL_FILE_SUFFIX = ".pkvpool"
#: How the names of promoted pools' files start (:func:`promoted_file_name`; declared pools' start with ``pool-``).
PROMOTED_FILE_PREFIX = "auto-"
#: What the name of a partial file (a save in progress, or one a killed save left) contains.
PARTIAL_MARK = f"{POOL_FILE_SUFFIX}.part."
#: Partial files younger than this (seconds since their last write) may be saves in progress:
#: :meth:`PoolCache.evict` leaves them alone (:meth:`PoolCache.clear` does not).
PARTIAL_MIN_AGE_S = 600.0
#: Default size limit of a :class:`PoolCache` (``$POLYKV_POOL_CACHE_MAX_MB`` overrides it).
DEFAULT_MAX_BYTES = 8 * 2**30
MAX_ENV = "POLYKV_POOL_CACHE_MAX_MB"


def tokens_mac(tokens: Sequence[int], cache_salt: str) -> str:
    """How ``/slots`` names the tokens of a pool salted with ``cache_salt``: HMAC-SHA256 keyed with the
    salt's UTF-8 bytes over the tokens packed as little-endian int32 (hex)."""
    msg = struct.pack(f"<{len(tokens)}i", *tokens)
    return hmac.new(cache_salt.encode("utf-8"), msg, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class PoolState:
    """One reserved pool as ``GET /slots`` reports it (``polykv_pool_state``).

    An unsalted pool shows its token count, the sha256 of its tokens and the file it was last
    restored from. A salted pool shows none of these, only ``tokens_mac`` (:func:`tokens_mac`:
    keyed with the salt), so that :meth:`holds` tells a client with the salt whether the pool
    holds its tokens and tells others nothing.
    """

    slot: int
    n_tokens: int | None  # None: salted (not shown)
    resident: bool
    salted: bool | str  # True, False, or "mixed" (cells of several salts)
    tokens_sha256: str | None  # unsalted pools only
    tokens_mac: str | None  # salted pools only: HMAC-SHA256(salt, tokens)
    hits: int  # shares taken from it since the server started
    sharers: int  # slots that still hold its cells
    last_use_s_ago: float | None
    restored_from: str | None  # the file of its last restore (None: primed, never filled, or salted)
    promoted: bool = False  # holds a prefix --share-any promoted (or a file of one, restored as such)

    @classmethod
    def from_slot(cls, slot: Json) -> PoolState | None:
        """The pool state of one ``/slots`` entry (None for a slot that is not a reserved pool)."""
        st = slot.get("polykv_pool_state")
        if not isinstance(st, dict):
            return None
        n_tokens = st.get("n_tokens")
        salted = st.get("salted", st.get("salt_sha256") is not None)  # a server before issue 26 had salt_sha256
        return cls(
            slot=int(slot["id"]),
            n_tokens=None if n_tokens is None else int(n_tokens),
            resident=bool(st.get("resident")),
            salted=salted if salted == "mixed" else bool(salted),
            tokens_sha256=st.get("tokens_sha256"),
            tokens_mac=st.get("tokens_mac"),
            hits=int(st.get("hits", 0)),
            sharers=int(st.get("sharers", 0)),
            last_use_s_ago=st.get("last_use_s_ago"),
            restored_from=st.get("restored_from"),
            promoted=bool(st.get("promoted")),
        )

    @property
    def empty(self) -> bool:
        """Nothing resident, or no tokens (a salted resident pool is not empty: its count is not shown)."""
        return not self.resident or self.n_tokens == 0

    def holds(self, tokens: Sequence[int], cache_salt: str | None = None) -> bool:
        """True when the pool is resident with exactly ``tokens`` primed under ``cache_salt``.

        Unsalted (``cache_salt`` None or empty): the pool is unsalted and its ``tokens_sha256``
        matches. Salted: the pool is salted (with one salt) and its ``tokens_mac`` equals
        :func:`tokens_mac` of ``tokens`` under ``cache_salt``; another salt never matches.
        """
        if not self.resident or not tokens:
            return False
        if cache_salt:
            return (
                self.salted is True
                and isinstance(self.tokens_mac, str)
                and hmac.compare_digest(self.tokens_mac, tokens_mac(tokens, cache_salt))
            )
        return self.salted is False and self.tokens_sha256 is not None and self.tokens_sha256 == tokens_sha256(tokens)


def pool_states(slots: Sequence[Json]) -> list[PoolState]:
    """The reserved pools among a ``GET /slots`` answer."""
    return [s for s in (PoolState.from_slot(x) for x in slots) if s is not None]


def _salt_digest_for_file_name(salt: str | None) -> str:
    """What :func:`pool_file_name` hashes for a salt (a file name in the cache directory; the server
    shows no digest of a salt)."""
    return hashlib.sha256(salt.encode()).hexdigest() if salt else "-"


def pool_file_name(identity: Json, tokens: Sequence[int], cache_salt: str | None = None) -> str:
    """The cache file name of a pool: ``pool-<32 hex>.pkvpool``.

    The hash covers what a restore must match: the server's ``pool_files`` identity from
    ``/props`` (model sha256 and shape, KV layout, format), the tokens and the salt. A server
    with another model or KV layout therefore looks for another file (a miss), rather than
    being refused one, and pools of different salts get different files.
    """
    return _file_name("pool", identity, tokens_sha256(list(tokens)), cache_salt)


def promoted_file_name(identity: Json, sha256_of_tokens: str) -> str:
    """The cache file name of an unsalted pool ``--share-any`` promoted: ``auto-<32 hex>.pkvpool``
    (:func:`pool_file_name`'s hash; the prefix tells ``polykv serve`` which files to restore at start)."""
    return _file_name(PROMOTED_FILE_PREFIX.rstrip("-"), identity, sha256_of_tokens, None)


def _file_name(prefix: str, identity: Json, sha256_of_tokens: str, cache_salt: str | None) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode())
    h.update(sha256_of_tokens.encode())
    h.update(_salt_digest_for_file_name(cache_salt).encode())
    return f"{prefix}-{h.hexdigest()[:32]}{POOL_FILE_SUFFIX}"


def action_body(
    filename: str,
    *,
    tokens: Sequence[int] | None = None,
    cache_salt: str | None = None,
    sha256_of_tokens: str | None = None,
    promoted: bool | None = None,
) -> Json:
    """The body of ``POST /slots/N?action=save|restore`` for a pool file (``tokens``: what a restore
    expects the file to hold; ``cache_salt``: the pool's salt, sent on both for a salted pool;
    ``sha256_of_tokens``: a save is refused unless the pool holds those tokens; ``promoted``: a
    restore marks the pool as a ``--share-any`` promoted prefix, which later promotions may replace)."""
    body: Json = {"filename": filename}
    if tokens is not None:
        body["tokens"] = list(tokens)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if sha256_of_tokens is not None:
        body["tokens_sha256"] = sha256_of_tokens
    if promoted is not None:
        body["promoted"] = promoted
    return body


def is_missing(exc: HTTPError) -> bool:
    """A restore refused because the file does not exist (a cache miss, not a bad file)."""
    return exc.status == 400 and "no such file" in exc.server_message


@dataclass(frozen=True)
class PoolCacheEntry:
    """One file of a :class:`PoolCache` (or a partial file a save is writing or a killed save left)."""

    name: str
    size: int
    last_use: float  # the file's mtime: set when it is written or restored
    n_tokens: int | None  # None: the header is unreadable (damaged or not a pool file), or a partial file
    model: str | None  # the model's description
    created_by: str | None

    def to_json(self) -> Json:
        return {
            "name": self.name,
            "size": self.size,
            "last_use": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.last_use)),
            "n_tokens": self.n_tokens,
            "model": self.model,
            "created_by": self.created_by,
        }


def _describe(path: Path) -> tuple[int | None, str | None, str | None]:
    """(n_tokens, model description, created_by) from a pool file's header; all None when it cannot be
    read or is malformed, whatever is in it (a header nested too deep for the JSON parser included)."""
    try:
        header = read_prefix_header(path)
    except (StateError, OSError, ValueError, RecursionError, MemoryError):
        return None, None, None
    if not isinstance(header, dict):
        return None, None, None
    n = header.get("n_tokens")
    model = header.get("model")
    description = model.get("description") if isinstance(model, dict) else None
    by = header.get("created_by")
    return (
        n if isinstance(n, int) and not isinstance(n, bool) else None,
        description if isinstance(description, str) else None,
        by if isinstance(by, str) else None,
    )


class PoolCache:
    """A directory of pool files, also the server's ``--slot-save-path``.

    ``directory=None`` means the save path of a server this process did not start: files are
    saved and restored there by name, and nothing is listed or removed from here. ``max_bytes``
    bounds the directory, partial files (``*.pkvpool.part.*``: a save in progress, or what a
    killed one left) included: after a save, partial files not written to for
    :data:`PARTIAL_MIN_AGE_S` go first (oldest first), then the least recently used pool files
    (not the one just written), until the rest fit.
    """

    def __init__(self, directory: str | os.PathLike[str] | None, max_bytes: int | None = None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else None
        env = os.environ.get(MAX_ENV)
        self.max_bytes = max_bytes if max_bytes is not None else int(env) * 2**20 if env else DEFAULT_MAX_BYTES
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, not {self.max_bytes}")
        if self.directory is not None:  # the server refuses a directory its group or others can write
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    @classmethod
    def default(cls, max_bytes: int | None = None) -> PoolCache:
        """``<polykv cache>/pools`` (see :func:`polykv_py.cache.cache_dir`)."""
        return cls(cache_dir() / "pools", max_bytes)

    @property
    def save_path(self) -> str | None:
        """The ``--slot-save-path`` a server started for this cache needs (with its trailing slash)."""
        return None if self.directory is None else f"{self.directory}{os.sep}"

    def _listing(self) -> list[tuple[Path, os.stat_result]]:
        """Regular files of the directory (not following symlinks) with their stat, sorted by name;
        a file removed while listing is left out."""
        if self.directory is None:
            return []
        out = []
        for p in sorted(self.directory.iterdir()):
            with contextlib.suppress(FileNotFoundError):
                st = p.lstat()
                if stat.S_ISREG(st.st_mode):
                    out.append((p, st))
        return out

    def entries(self) -> list[PoolCacheEntry]:
        """The pool files, most recently used first (an unreadable one has ``n_tokens`` None)."""
        out = []
        for p, st in self._listing():
            if p.name.endswith(POOL_FILE_SUFFIX):
                out.append(PoolCacheEntry(p.name, st.st_size, st.st_mtime, *_describe(p)))
        return sorted(out, key=lambda e: e.last_use, reverse=True)

    def partials(self) -> list[PoolCacheEntry]:
        """Partial files (saves in progress, or left by killed ones), oldest first."""
        out = [
            PoolCacheEntry(p.name, st.st_size, st.st_mtime, None, None, None)
            for p, st in self._listing()
            if PARTIAL_MARK in p.name
        ]
        return sorted(out, key=lambda e: e.last_use)

    def total_bytes(self) -> int:
        """Bytes of the pool files and the partial files."""
        return sum(
            st.st_size for p, st in self._listing() if p.name.endswith(POOL_FILE_SUFFIX) or PARTIAL_MARK in p.name
        )

    # -- the lifecycle of a pool file: each caller makes the HTTP call, then tells the cache what happened
    def saved(self, name: str) -> None:
        """``name`` was just saved: trim the cache to its size limit, keeping ``name`` (a failure is logged)."""
        try:
            self.evict(keep=[name])
        except OSError as exc:
            log.warning("pool cache %s: could not trim it after saving %s: %s", self.directory, name, exc)

    def restored(self, name: str) -> None:
        """``name`` was just restored: mark it used now, so eviction keeps it longest."""
        self.touch(name)

    @staticmethod
    def restore_failed(exc: HTTPError, name: str, *, then: str = "priming and saving it again") -> None:
        """A restore of ``name`` failed: a miss (no such file) is silent, a refused file is logged with the
        server's reason and what the caller does ``then``."""
        if not is_missing(exc):
            log.warning("pool file %s refused (%s): %s", name, exc.server_message or exc, then)

    def touch(self, name: str) -> None:
        """Mark ``name`` as used now (its mtime), so eviction keeps it longest."""
        if self.directory is not None:
            with contextlib.suppress(FileNotFoundError):
                os.utime(self.directory / name)

    def _remove(self, e: PoolCacheEntry, why: str) -> bool:
        assert self.directory is not None
        try:
            (self.directory / e.name).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("pool cache: could not remove %s: %s", e.name, exc)
            return False
        log.info("pool cache: removed %s (%d bytes, %s) to stay under %d bytes", e.name, e.size, why, self.max_bytes)
        return True

    def evict(self, keep: Sequence[str] = (), *, now: float | None = None) -> list[PoolCacheEntry]:
        """Remove files until the rest fit ``max_bytes``: first partial files not written to for
        :data:`PARTIAL_MIN_AGE_S` (oldest first; younger ones may be saves in progress), then the
        least recently used pool files (never those in ``keep``). A file that cannot be removed is
        logged and skipped."""
        removed: list[PoolCacheEntry] = []
        entries, partials = self.entries(), self.partials()
        total = sum(e.size for e in entries) + sum(e.size for e in partials)
        now = time.time() if now is None else now
        stale = [e for e in partials if now - e.last_use >= PARTIAL_MIN_AGE_S]
        candidates = [(e, "partial file of an interrupted save") for e in stale]
        candidates += [(e, "least recently used") for e in reversed(entries) if e.name not in keep]
        for e, why in candidates:
            if total <= self.max_bytes:
                break
            if self._remove(e, why):
                total -= e.size
                removed.append(e)
        return removed

    def clear(self) -> int:
        """Remove every pool file and every partial file (whatever its age); returns how many."""
        if self.directory is None:
            return 0
        n = 0
        for p in self.directory.iterdir():
            if not (p.name.endswith(POOL_FILE_SUFFIX) or PARTIAL_MARK in p.name):
                continue
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(p.lstat().st_mode) or p.is_symlink():  # a link goes, not what it points to
                    p.unlink()
                    n += 1
        return n

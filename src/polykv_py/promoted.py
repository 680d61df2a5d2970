"""Promoted pools kept across restarts: what ``polykv serve`` adds to ``--share-any``.

With ``--share-any`` the server copies a prefix that a request shared from an agent's slot into
a free reserved pool (patch 0077, "promotion"), so that it outlives the agents' slots.
:class:`PromotedPoolKeeper` keeps those pools in the pool cache: each unsalted promoted pool is
saved once, as ``auto-<hash>.pkvpool`` (:func:`~polykv_py.pools.promoted_file_name`; the server
refuses the save if the pool changed since it was listed), and a file whose pool keeps being
shared from is marked as used. :func:`restore_promoted` restores the most recently used such
files of this server's model and KV layout into free reserved pools at start, marked as
promoted, so that later promotions replace them least recently used first.

Salted pools are not saved: the launcher does not hold their salt (the server refuses a save
without it), and a tenant's KV goes to disk only when a holder of its salt asks for it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from .client import Client
from .errors import HTTPError, StateError
from .jsontypes import Json
from .pools import PROMOTED_FILE_PREFIX, PoolCache, PoolCacheEntry, PoolState, promoted_file_name
from .prefix_file import read_prefix_header

log = logging.getLogger(__name__)


def promoted_files(cache: PoolCache, identity: Json) -> list[PoolCacheEntry]:
    """The cache's unsalted promoted-pool files written by a server with this ``pool_files`` identity
    (``/props``: format, model, KV layout), most recently used first. Headers are read, not
    authenticated: the server verifies a file when it restores it."""
    if cache.directory is None:
        return []
    out = []
    for e in cache.entries():
        if not e.name.startswith(PROMOTED_FILE_PREFIX) or e.n_tokens is None:
            continue
        try:
            header = read_prefix_header(cache.directory / e.name)
        except (StateError, OSError, ValueError):
            continue
        if header.get("salt_mac") or any(header.get(k) != v for k, v in identity.items()):
            continue
        out.append(e)
    return out


@dataclass(frozen=True)
class RestoredPool:
    """A promoted pool restored at start: its slot, the file and the tokens it holds."""

    slot: int
    name: str
    n_tokens: int


def restore_promoted(client: Client, cache: PoolCache, slots: Sequence[int]) -> list[RestoredPool]:
    """Restore the most recently used promoted-pool files of this server into ``slots`` (free reserved
    pools), one each, marked as promoted. A file the server refuses (damaged, another key) is logged and
    the next one tried; the files left over stay in the cache (its size limit removes them in time)."""
    identity = client.pool_features().pool_files
    if identity is None or not slots:
        return []
    candidates = iter(promoted_files(cache, identity))
    out: list[RestoredPool] = []
    for slot in slots:
        for entry in candidates:
            try:
                client.restore_pool(slot, entry.name, promoted=True)
            except HTTPError as exc:
                cache.restore_failed(exc, entry.name, then="trying the next one")
                continue
            cache.restored(entry.name)
            n_tokens = entry.n_tokens or 0
            log.info("pool slot %d: promoted prefix, %d tokens, restored from %s", slot, n_tokens, entry.name)
            out.append(RestoredPool(slot, entry.name, n_tokens))
            break
    return out


class PromotedPoolKeeper:
    """Saves each unsalted promoted pool of a ``--share-any`` server to the pool cache once; call
    :meth:`poll` now and then (``polykv serve`` does every few seconds)."""

    def __init__(self, client: Client, cache: PoolCache) -> None:
        self.client = client
        self.cache = cache
        self._hits: dict[str, int] = {}  # files saved or found, with the pool's hits when last seen
        self._refused: set[str] = set()  # saves refused for a reason other than a change of the pool

    def poll(self) -> list[str]:
        """Save the promoted pools not in the cache yet, mark the files of pools shared since the last
        poll as used; returns the names saved. A refused save is logged once per file."""
        identity = self.client.pool_features().pool_files
        if identity is None:
            return []
        saved = []
        for pool in self.client.pools():
            name = self._name(pool, identity)
            if name is None or name in self._refused:
                continue
            if name in self._hits:
                if pool.hits > self._hits[name]:
                    self.cache.touch(name)
                self._hits[name] = pool.hits
            elif self.cache.directory is not None and (self.cache.directory / name).is_file():
                self._hits[name] = pool.hits
                self.cache.touch(name)
            elif self._save(pool, name):
                self._hits[name] = pool.hits
                saved.append(name)
        return saved

    @staticmethod
    def _name(pool: PoolState, identity: Json) -> str | None:
        if not (pool.promoted and pool.resident and pool.salted is False and pool.tokens_sha256):
            return None
        return promoted_file_name(identity, pool.tokens_sha256)

    def _save(self, pool: PoolState, name: str) -> bool:
        try:
            self.client.save_pool(pool.slot, name, sha256_of_tokens=pool.tokens_sha256)
        except HTTPError as exc:
            if "other tokens than expected" not in exc.server_message:  # else: replaced since listed, next poll
                self._refused.add(name)
                why = exc.server_message or exc
                log.warning("pool slot %d: could not save its promoted prefix as %s: %s", pool.slot, name, why)
            return False
        log.info("pool slot %d: saved its promoted prefix (%s tokens) as %s", pool.slot, pool.n_tokens, name)
        self.cache.saved(name)
        return True

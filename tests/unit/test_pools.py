"""The pool cache on disk and the pool states /slots reports (no server)."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from pathlib import Path

import pytest

from polykv_py import pools as pools_module
from polykv_py.cli import app as cli
from polykv_py.errors import HTTPError
from polykv_py.pools import (
    PARTIAL_MIN_AGE_S,
    PROMOTED_FILE_PREFIX,
    PoolCache,
    PoolState,
    action_body,
    is_missing,
    pool_file_name,
    pool_states,
    promoted_file_name,
    tokens_mac,
)
from polykv_py.prefix_file import KEY_FILE, MAGIC, tokens_sha256, write_prefix_file

IDENTITY = {
    "format": 2,
    "model": {"sha256": "ab" * 32, "n_layer": 30},
    "kv": {"n_stream": 1, "type_k": "f16", "type_v": "f16"},
}


def test_file_names_hash_identity_tokens_and_salt() -> None:
    name = pool_file_name(IDENTITY, [1, 2, 3])
    assert name.startswith("pool-") and name.endswith(".pkvpool") and len(name) == len("pool-") + 32 + len(".pkvpool")
    assert name == pool_file_name(dict(reversed(list(IDENTITY.items()))), [1, 2, 3]), "key order must not matter"
    others = {
        pool_file_name(IDENTITY, [1, 2, 4]),
        pool_file_name(IDENTITY, [1, 2, 3], "team-a"),
        pool_file_name(IDENTITY, [1, 2, 3], "team-b"),
        pool_file_name({**IDENTITY, "kv": {**IDENTITY["kv"], "n_stream": 4}}, [1, 2, 3]),
        pool_file_name({**IDENTITY, "model": {**IDENTITY["model"], "sha256": "cd" * 32}}, [1, 2, 3]),
    }
    assert name not in others and len(others) == 5
    assert "team" not in pool_file_name(IDENTITY, [1], "team-a")
    assert pool_file_name(IDENTITY, [1, 2, 3], "") == name, "an empty salt is no salt"
    assert not hasattr(pools_module, "salt_sha256"), "nothing may suggest /slots shows a hash of the salt"


def test_promoted_pools_files_are_named_apart_from_declared_pools() -> None:
    sha = tokens_sha256([1, 2, 3])
    name = promoted_file_name(IDENTITY, sha)
    assert name.startswith(PROMOTED_FILE_PREFIX) and name.endswith(".pkvpool")
    assert name[len(PROMOTED_FILE_PREFIX) :] == pool_file_name(IDENTITY, [1, 2, 3])[len("pool-") :], "same hash"
    assert promoted_file_name(IDENTITY, tokens_sha256([1, 2])) != name
    assert promoted_file_name({**IDENTITY, "format": 3}, sha) != name, "another server layout, another file"


def test_action_bodies_send_only_what_is_given() -> None:
    assert action_body("f.pkvpool") == {"filename": "f.pkvpool"}
    assert action_body("f.pkvpool", sha256_of_tokens="ab", promoted=True) == {
        "filename": "f.pkvpool",
        "tokens_sha256": "ab",
        "promoted": True,
    }
    assert action_body("f.pkvpool", tokens=(1, 2), cache_salt="s") == {
        "filename": "f.pkvpool",
        "tokens": [1, 2],
        "cache_salt": "s",
    }


def _file(cache: PoolCache, name: str, n_bytes: int, age_s: float) -> None:
    assert cache.directory is not None
    path = cache.directory / name
    write_prefix_file(path, b"\0" * n_bytes, model={"description": "m"}, tokens=[1, 2], kv={"n_stream": 1})
    t = path.stat().st_mtime - age_s
    os.utime(path, (t, t))


def test_eviction_removes_least_recently_used_first(tmp_path: Path) -> None:
    cache = PoolCache(tmp_path, max_bytes=3500)
    for i, age in enumerate((30, 20, 10)):
        _file(cache, f"pool-{i}.pkvpool", 1000, age)
    assert [e.name for e in cache.entries()] == ["pool-2.pkvpool", "pool-1.pkvpool", "pool-0.pkvpool"]
    assert cache.entries()[0].n_tokens == 2 and cache.entries()[0].created_by == "polykv engine"
    cache.touch("pool-0.pkvpool")  # used now: kept longest
    removed = cache.evict()
    assert [e.name for e in removed] == ["pool-1.pkvpool"]
    assert cache.total_bytes() <= 3500
    cache.max_bytes = 0
    assert [e.name for e in cache.evict(keep=["pool-0.pkvpool"])] == ["pool-2.pkvpool"]
    assert [e.name for e in cache.entries()] == ["pool-0.pkvpool"]


def test_clear_removes_pool_files_and_partial_saves_only(tmp_path: Path) -> None:
    cache = PoolCache(tmp_path)
    _file(cache, "pool-a.pkvpool", 10, 0)
    (tmp_path / "pool-b.pkvpool.part.123").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "broken.pkvpool").write_bytes(b"nope")
    assert {e.name: e.n_tokens for e in cache.entries()} == {"pool-a.pkvpool": 2, "broken.pkvpool": None}
    assert cache.clear() == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [KEY_FILE, "notes.txt"], "the directory's key stays"


def test_server_side_cache_lists_nothing(tmp_path: Path) -> None:
    cache = PoolCache(None)
    assert cache.save_path is None and cache.entries() == [] and cache.clear() == 0 and cache.evict() == []
    assert PoolCache(tmp_path).save_path == f"{tmp_path}{os.sep}"
    with pytest.raises(ValueError, match="max_bytes"):
        PoolCache(tmp_path, max_bytes=-1)


def test_pool_states_from_slots() -> None:
    slots = [
        {"id": 0, "polykv_pool": True, "polykv_pool_state": {"resident": True, "salted": False, "n_tokens": 9,
         "tokens_sha256": "t", "tokens_mac": None, "hits": 3, "sharers": 2, "last_use_s_ago": 1.5,
         "restored_from": "p.pkvpool", "promoted": True}},
        {"id": 1, "n_ctx": 100},
        {"id": 2, "polykv_pool": True, "polykv_pool_state": {"resident": True, "salted": True, "n_tokens": None,
         "tokens_sha256": None, "tokens_mac": "m", "hits": 0, "sharers": 0, "last_use_s_ago": None,
         "restored_from": None}},
        {"id": 3, "polykv_pool": True, "polykv_pool_state": {"resident": True, "salted": "mixed", "n_tokens": None,
         "tokens_sha256": None, "tokens_mac": None, "hits": 0, "sharers": 1, "last_use_s_ago": 0.5,
         "restored_from": None}},
    ]  # fmt: skip
    assert pool_states(slots) == [
        PoolState(0, 9, True, False, "t", None, 3, 2, 1.5, "p.pkvpool", promoted=True),
        PoolState(2, None, True, True, None, "m", 0, 0, None, None),
        PoolState(3, None, True, "mixed", None, None, 0, 1, 0.5, None),
    ]
    assert PoolState.from_slot(slots[1]) is None
    assert not pool_states(slots)[1].empty, "a salted resident pool hides its count but is not empty"


def test_tokens_mac_is_hmac_sha256_keyed_with_the_salt() -> None:
    tokens = [1, 2, 3, 70000, -1]
    packed = b"".join(struct.pack("<i", t) for t in tokens)
    assert tokens_mac(tokens, "team-a") == hmac.new(b"team-a", packed, hashlib.sha256).hexdigest()
    assert tokens_mac(tokens, "équipe") == hmac.new("équipe".encode(), packed, hashlib.sha256).hexdigest()
    assert tokens_mac(tokens, "team-a") != tokens_mac(tokens, "team-b") != tokens_sha256(tokens)


def _state(
    tokens: list[int], salt: str | None, *, resident: bool = True, salted: bool | str | None = None
) -> PoolState:
    """A /slots pool state as the server reports a pool primed with ``tokens`` under ``salt``."""
    return PoolState(
        slot=0,
        n_tokens=None if salt else len(tokens),
        resident=resident,
        salted=bool(salt) if salted is None else salted,
        tokens_sha256=None if salt else tokens_sha256(tokens),
        tokens_mac=tokens_mac(tokens, salt) if salt else None,
        hits=0,
        sharers=0,
        last_use_s_ago=None,
        restored_from=None,
    )


def test_holds_needs_the_same_tokens_and_the_same_salt() -> None:
    toks = [5, 6, 7]
    plain, salted = _state(toks, None), _state(toks, "team-a")
    assert plain.holds(toks) and plain.holds(toks, None) and plain.holds(toks, "")
    assert not plain.holds([5, 6]) and not plain.holds(toks, "team-a"), "an unsalted pool is not a salted one"
    assert salted.holds(toks, "team-a")
    assert not salted.holds(toks), "a salted pool is no match without its salt"
    assert not salted.holds(toks, "team-b") and not salted.holds([5, 6], "team-a")
    assert not _state(toks, None, resident=False).holds(toks)
    assert not _state(toks, "team-a", resident=False).holds(toks, "team-a")
    assert not _state(toks, "team-a", salted="mixed").holds(toks, "team-a")
    assert not plain.holds([]) and not PoolState(0, 0, True, False, tokens_sha256([]), None, 0, 0, None, None).holds([])


def test_a_missing_file_is_a_miss_other_refusals_are_not() -> None:
    assert is_missing(HTTPError(400, "Unable to restore pool slot 0: no such file"))
    assert not is_missing(HTTPError(400, "Unable to restore pool slot 0: saved from another model"))
    assert not is_missing(HTTPError(501, "no such file"))


def test_a_header_nested_too_deep_is_an_unreadable_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """json.loads raises RecursionError (not ValueError) on deep nesting: `pools list` must list the file, not crash."""
    cache = PoolCache(tmp_path)
    _file(cache, "pool-good.pkvpool", 10, 0)
    body = b"[" * 100_000
    (tmp_path / "pool-deep.pkvpool").write_bytes(MAGIC + struct.pack("<I", len(body)) + body)
    odd = b'{"format":3,"model":7,"n_tokens":"x","created_by":[]}'  # well-formed JSON, wrong types
    (tmp_path / "pool-odd.pkvpool").write_bytes(MAGIC + struct.pack("<I", len(odd)) + odd)
    assert {e.name: e.n_tokens for e in cache.entries()} == {
        "pool-good.pkvpool": 2,
        "pool-deep.pkvpool": None,
        "pool-odd.pkvpool": None,
    }
    assert cli.main(["pools", "list", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pool-deep.pkvpool" in out and "unreadable header" in out


def _partial(directory: Path, name: str, n_bytes: int, age_s: float) -> Path:
    path = directory / name
    path.write_bytes(b"\0" * n_bytes)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_partial_files_count_and_stale_ones_are_evicted_first(tmp_path: Path) -> None:
    cache = PoolCache(tmp_path, max_bytes=20_000)
    _file(cache, "pool-a.pkvpool", 1000, 30)
    old = PARTIAL_MIN_AGE_S
    _partial(tmp_path, "pool-b.pkvpool.part.111", 3000, old + 100)  # killed long ago
    _partial(tmp_path, "pool-c.pkvpool.part.222", 2000, old + 50)  # killed, more recently
    _partial(tmp_path, "pool-d.pkvpool.part.333", 4000, 5)  # maybe a save in progress
    pool_bytes = (tmp_path / "pool-a.pkvpool").stat().st_size
    assert cache.total_bytes() == pool_bytes + 9000
    assert [e.name for e in cache.partials()] == [
        "pool-b.pkvpool.part.111",
        "pool-c.pkvpool.part.222",
        "pool-d.pkvpool.part.333",
    ]
    assert [e.name for e in cache.entries()] == ["pool-a.pkvpool"], "partial files are not pool files"
    assert cache.evict() == [], "under the limit nothing goes"

    cache.max_bytes = pool_bytes + 5000  # over by 4000: the oldest stale partial (3000) is not enough
    removed = cache.evict()
    assert [e.name for e in removed] == ["pool-b.pkvpool.part.111", "pool-c.pkvpool.part.222"]
    assert (tmp_path / "pool-a.pkvpool").exists(), "stale partial files go before any pool file"

    cache.max_bytes = 0  # only the young partial and the pool file are left
    assert [e.name for e in cache.evict()] == ["pool-a.pkvpool"]
    assert [e.name for e in cache.partials()] == ["pool-d.pkvpool.part.333"], "a save in progress is never evicted"
    assert [e.name for e in cache.evict(now=time.time() + PARTIAL_MIN_AGE_S)] == ["pool-d.pkvpool.part.333"]


def test_clear_removes_young_partial_files_too(tmp_path: Path) -> None:
    cache = PoolCache(tmp_path, max_bytes=0)
    _partial(tmp_path, "pool-d.pkvpool.part.333", 100, 1)
    assert cache.evict() == [] and cache.total_bytes() == 100
    assert cache.clear() == 1 and cache.total_bytes() == 0

"""The pool cache on disk and the pool states /slots reports (no server)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from polykv_py.errors import HTTPError
from polykv_py.llama.state import write_prefix_file
from polykv_py.pools import PoolCache, PoolState, is_missing, pool_file_name, pool_states, salt_sha256

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
    assert salt_sha256(None) is None and salt_sha256("") is None and len(salt_sha256("x") or "") == 64


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_server_side_cache_lists_nothing(tmp_path: Path) -> None:
    cache = PoolCache(None)
    assert cache.save_path is None and cache.entries() == [] and cache.clear() == 0 and cache.evict() == []
    assert PoolCache(tmp_path).save_path == f"{tmp_path}{os.sep}"
    with pytest.raises(ValueError, match="max_bytes"):
        PoolCache(tmp_path, max_bytes=-1)


def test_pool_states_from_slots() -> None:
    slots = [
        {"id": 0, "polykv_pool": True, "polykv_pool_state": {"n_tokens": 9, "resident": True, "tokens_sha256": "t",
         "salt_sha256": None, "hits": 3, "sharers": 2, "last_use_s_ago": 1.5, "restored_from": "p.pkvpool"}},
        {"id": 1, "n_ctx": 100},
    ]  # fmt: skip
    assert pool_states(slots) == [PoolState(0, 9, True, "t", None, 3, 2, 1.5, "p.pkvpool")]
    assert PoolState.from_slot(slots[1]) is None


def test_a_missing_file_is_a_miss_other_refusals_are_not() -> None:
    assert is_missing(HTTPError(400, "Unable to restore pool slot 0: no such file"))
    assert not is_missing(HTTPError(400, "Unable to restore pool slot 0: saved from another model"))
    assert not is_missing(HTTPError(501, "no such file"))

"""Pool files and salts against someone who should not get a hit (issue 26), on the real server.

An attacker who can write the pool directory but does not hold its key (``.polykv-pool.key``)
cannot plant KV: every forged file is refused before any of it is used, and sharers miss. A
salted pool tells a caller without its salt nothing (one refusal, no detail; no hash of the salt
or of its tokens in ``/slots``) and cannot be overwritten without it. Settings that change the
KV are part of a pool file's identity. Cells a slot took from the host prompt cache are never a
share's source (their salt and LoRA set are unknown).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polykv_py.client import Client, Share
from polykv_py.errors import HTTPError
from polykv_py.llama_server import LlamaServer
from polykv_py.pools import pool_file_name
from polykv_py.prefix_file import KEY_FILE, MAC_BYTES, MAGIC, pool_key, tokens_sha256
from polykv_py.presets import NO_CLEAR_IDLE, NO_HOST_CACHE, UNIFIED_KV, pool_slot_args, slots_args

pytestmark = pytest.mark.integration

POOL, AGENT = 0, 1
CTX = 4096
GREEDY: dict[str, Any] = {"temperature": 0, "n_predict": 4, "cache_prompt": True}
BASE = "\n".join(f"Record {i}: vault {i % 9} holds {i * 7 % 53} sealed boxes from shipment {i}." for i in range(30))
QUESTION = "\nQuestion: what does vault 4 hold?\nAnswer:"
SALT_REFUSAL = "the pool file does not match this request"


def server_args(save: Path, *extra: str) -> list[str]:
    return [UNIFIED_KV, *slots_args(2, CTX), *NO_HOST_CACHE, "--slots", "--slot-save-path", f"{save}/",
            *pool_slot_args([POOL]), *extra]  # fmt: skip


def start(bin_: Path, model: Path, logs: Path, args: list[str], name: str) -> LlamaServer:
    # LLAMA_SERVER_SLOTS_DEBUG=1: /slots shows prompt texts, the most a key holder can see
    env = {"LLAMA_SERVER_SLOTS_DEBUG": "1"}
    return LlamaServer(bin_, model, args, log_dir=logs, name=name, threads=2, env=env).start()


@pytest.fixture(scope="module")
def srv(patched_server_bin: Path, model_path: Path, save_dir: Path, logs: Path) -> Iterator[LlamaServer]:
    s = start(patched_server_bin, model_path, logs, server_args(save_dir), "pool-security")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def genuine(srv: LlamaServer, save_dir: Path) -> dict[str, Any]:
    """A pool primed and saved by the server itself: ``{"tokens", "file", "answer"}``."""
    with Client(srv.url) as c:
        tokens = c.prompt_tokens(BASE)
        c.erase_slot(POOL)
        c.prime(tokens, POOL)
        c.erase_slot(AGENT)
        answer = c.completion(BASE + QUESTION, share=Share(POOL), id_slot=AGENT, **GREEDY)
        assert answer["shared_prefix"]["status"] == "hit"
        c.save_pool(POOL, "genuine.pkvpool")
    return {"tokens": tokens, "file": save_dir / "genuine.pkvpool", "answer": answer["content"]}


def split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, state) of a format-3 file."""
    (n,) = struct.unpack("<I", raw[len(MAGIC) : len(MAGIC) + 4])
    return json.loads(raw[len(MAGIC) + 4 : len(MAGIC) + 4 + n]), raw[len(MAGIC) + 4 + n : len(raw) - MAC_BYTES]


def pack(header: dict[str, Any], state: bytes, key: bytes | None) -> bytes:
    """A file with this header and state, MACed with ``key`` (None: the trailer a forger without the key can make)."""
    head = json.dumps(header).encode()
    body = MAGIC + struct.pack("<I", len(head)) + head + state
    tag = hmac.new(key, body, hashlib.sha256).digest() if key is not None else hashlib.sha256(body).digest()
    return body + tag


def refusal(c: Client, name: str, **kw: Any) -> str:
    with pytest.raises(HTTPError) as err:
        c.restore_pool(POOL, name, **kw)
    assert err.value.status == 400
    return err.value.server_message


def pool_state(c: Client) -> dict[str, Any]:
    (slot,) = [s for s in c.slots() if s["id"] == POOL]
    return dict(slot["polykv_pool_state"])


def share_status(c: Client, **kw: Any) -> str:
    c.erase_slot(AGENT)
    res = c.completion(BASE + QUESTION, share=Share(POOL), id_slot=AGENT, **GREEDY, **kw)
    return str(res["shared_prefix"]["status"])


# ------------------------------------------------------------------------------ forged files
def test_forged_files_are_refused_and_sharers_miss(srv: LlamaServer, genuine: dict[str, Any], save_dir: Path) -> None:
    """The attacker writes the pool directory but has no key: planted KV never gives a hit."""
    header, state = split(genuine["file"].read_bytes())
    other = [*genuine["tokens"][:-5], *([198] * 5)]  # a header claiming other tokens over the genuine state
    forged_header = dict(header, tokens=other, tokens_sha256=tokens_sha256(other))
    planted = {
        "unkeyed.pkvpool": pack(forged_header, state, None),  # the old formats' "checksum"
        "own-key.pkvpool": pack(forged_header, state, os.urandom(32)),  # a key of the attacker's own
        "same-header.pkvpool": pack(header, bytes(len(state)), None),  # the genuine header over zeroed KV
    }
    for name, raw in planted.items():
        (save_dir / name).write_bytes(raw)
    (save_dir / "linked.pkvpool").symlink_to(genuine["file"])
    with Client(srv.url) as c:
        c.erase_slot(POOL)
        for name in planted:
            assert "authentication failed" in refusal(c, name, tokens=other), name
            assert not pool_state(c)["resident"], name
            assert share_status(c) != "hit", name
        assert "symbolic link" in refusal(c, "linked.pkvpool")
        assert share_status(c) != "hit"
        # the genuine file still restores and shares exactly
        c.restore_pool(POOL, "genuine.pkvpool", tokens=genuine["tokens"])
        c.erase_slot(AGENT)
        res = c.completion(BASE + QUESTION, share=Share(POOL), id_slot=AGENT, **GREEDY)
    assert res["shared_prefix"]["status"] == "hit" and res["content"] == genuine["answer"]


def test_state_with_extra_cells_is_refused_even_when_authentic(
    srv: LlamaServer, genuine: dict[str, Any], save_dir: Path
) -> None:
    """Whoever holds the key still cannot make the server load cells that are not one per position 0..n-1."""
    key = pool_key(save_dir, create=False)
    header, state = split(genuine["file"].read_bytes())
    shifted = bytearray(state)
    # the first cell's position (after u32 magic, i32 seq_id, u32 n_stream, u32 cell_count): 0 -> 5
    assert struct.unpack_from("<I", shifted, 0)[0] == 0xAF143CD8
    struct.pack_into("<i", shifted, 16, 5)
    (save_dir / "shifted.pkvpool").write_bytes(pack(header, bytes(shifted), key))
    fewer = dict(header, n_tokens=len(genuine["tokens"]) - 1, tokens=genuine["tokens"][:-1])
    fewer["tokens_sha256"] = tokens_sha256(fewer["tokens"])
    (save_dir / "fewer.pkvpool").write_bytes(pack(fewer, state, key))
    with Client(srv.url) as c:
        c.erase_slot(POOL)
        assert "one cell per position" in refusal(c, "shifted.pkvpool")
        assert "cells for" in refusal(c, "fewer.pkvpool")
        assert not pool_state(c)["resident"]


def test_part_file_link_is_not_followed(
    srv: LlamaServer, genuine: dict[str, Any], save_dir: Path, tmp_path: Path
) -> None:
    """A link planted where the server writes its temporary file never redirects the save."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    target = "linked-save.pkvpool"
    (save_dir / f"{target}.part.{srv.pid}").symlink_to(victim)
    with Client(srv.url) as c:
        c.restore_pool(POOL, "genuine.pkvpool")
        c.save_pool(POOL, target)
        c.restore_pool(POOL, target, tokens=genuine["tokens"])
    assert victim.read_text() == "keep me"
    assert not (save_dir / target).is_symlink()


def test_pool_directory_and_key_must_be_private(
    patched_server_bin: Path, model_path: Path, genuine: dict[str, Any], tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    open_key = tmp_path / "open-key"
    open_key.mkdir(mode=0o700)
    (open_key / KEY_FILE).write_bytes(os.urandom(32))
    (open_key / KEY_FILE).chmod(0o644)
    for d, reason in ((shared, "writable by its group or by others"), (open_key, "mode 0600")):
        d_copy = d / "genuine.pkvpool"
        d_copy.write_bytes(genuine["file"].read_bytes())
        s = start(patched_server_bin, model_path, tmp_path, server_args(d), f"pool-security-{d.name}")
        try:
            with Client(s.url) as c:
                assert reason in refusal(c, "genuine.pkvpool")
                c.prime(genuine["tokens"], POOL)
                with pytest.raises(HTTPError, match=reason):
                    c.save_pool(POOL, "new.pkvpool")
                assert not (d / "new.pkvpool").exists()
                assert c.completion("Hello", n_predict=2)["content"] is not None  # still serving
        finally:
            s.stop()


# ------------------------------------------------------------------------------ salts
def test_salted_pool_tells_nothing_without_its_salt(srv: LlamaServer, genuine: dict[str, Any], save_dir: Path) -> None:
    tokens = genuine["tokens"]
    with Client(srv.url) as c:
        c.erase_slot(POOL)
        c.prime(tokens, POOL, cache_salt="tenant-a")
        st = pool_state(c)
        expected_mac = hmac.new(b"tenant-a", struct.pack(f"<{len(tokens)}i", *tokens), hashlib.sha256).hexdigest()
        assert st["salted"] is True and st["tokens_mac"] == expected_mac
        assert st["tokens_sha256"] is None and st["n_tokens"] is None and "salt_sha256" not in st
        slots = {s["id"]: s for s in c.slots()}
        slot_json = json.dumps(slots[POOL])
        assert hashlib.sha256(b"tenant-a").hexdigest() not in slot_json and tokens_sha256(tokens) not in slot_json
        assert "Record 1" not in slot_json, "a salted task's prompt text is shown in /slots"
        assert "Record 1" in slots[AGENT]["prompt"]  # an unsalted task's is (LLAMA_SERVER_SLOTS_DEBUG=1)

        # saving needs the salt, with no detail otherwise
        for salt in (None, "tenant-b"):
            with pytest.raises(HTTPError) as err:
                c.save_pool(POOL, "tenant-a.pkvpool", cache_salt=salt)
            assert err.value.server_message.endswith(SALT_REFUSAL), err.value.server_message
        assert not (save_dir / "tenant-a.pkvpool").exists()
        c.save_pool(POOL, "tenant-a.pkvpool", cache_salt="tenant-a")
        raw = (save_dir / "tenant-a.pkvpool").read_bytes()
        assert b"tenant-a" not in raw and hashlib.sha256(b"tenant-a").hexdigest().encode() not in raw

        # restoring: the salt is checked first, and a refusal names nothing of the file
        wrong_tokens = [*tokens[:3], 7, *tokens[4:]]
        for kw in ({}, {"cache_salt": "tenant-b"}, {"cache_salt": "tenant-b", "tokens": wrong_tokens}):
            msg = refusal(c, "tenant-a.pkvpool", **kw)
            assert msg.endswith(SALT_REFUSAL) and "first difference" not in msg and "sha256" not in msg, msg

        # another tenant cannot overwrite tenant-a's file with its own (or an unsalted) pool
        c.erase_slot(POOL)
        c.prime(tokens, POOL)
        with pytest.raises(HTTPError) as err:
            c.save_pool(POOL, "tenant-a.pkvpool")
        assert err.value.server_message.endswith(SALT_REFUSAL)
        assert (save_dir / "tenant-a.pkvpool").read_bytes() == raw

        c.restore_pool(POOL, "tenant-a.pkvpool", cache_salt="tenant-a", tokens=tokens)
        assert pool_state(c)["restored_from"] is None  # a salted pool's file name is not shown either
        assert share_status(c, cache_salt="tenant-a") == "hit"
        assert share_status(c, cache_salt="tenant-b") == "salt_mismatch"


# ------------------------------------------------------------------------------ identity
def test_kv_settings_are_part_of_the_identity(
    patched_server_bin: Path,
    model_path: Path,
    srv: LlamaServer,
    genuine: dict[str, Any],
    save_dir: Path,
    tmp_path: Path,
) -> None:
    """A server whose RoPE or metadata overrides change the KV refuses the default server's file, and looks
    for another name."""
    with Client(srv.url) as c:
        default_identity = c.pool_features(refresh=True).pool_files
    assert default_identity["settings"] == {}
    for extra, key in (
        (("--rope-freq-base", "20000"), "rope_freq_base"),
        (("--override-kv", "llama.context_length=int:4096"), "override_kv"),
    ):
        s = start(patched_server_bin, model_path, tmp_path, server_args(save_dir, *extra), f"pool-security-{key}")
        try:
            with Client(s.url) as c:
                identity = c.pool_features(refresh=True).pool_files
                assert key in identity["settings"], identity
                assert "other KV settings" in refusal(c, "genuine.pkvpool")
                assert not pool_state(c)["resident"]
            assert pool_file_name(identity, genuine["tokens"]) != pool_file_name(default_identity, genuine["tokens"])
        finally:
            s.stop()


# ------------------------------------------------------------------------------ host prompt cache
def test_cells_from_the_host_cache_are_no_share_source(
    patched_server_bin: Path, model_path: Path, tmp_path: Path
) -> None:
    """Cells loaded from the host prompt cache were computed under a salt the slot does not know: no share."""
    args = [UNIFIED_KV, *slots_args(2, CTX), NO_CLEAR_IDLE, "--cache-ram", "256", "--slots"]
    s = start(patched_server_bin, model_path, tmp_path, args, "pool-security-host-cache")
    other = " ".join(f"unrelated{i}" for i in range(200))
    try:
        with Client(s.url) as c:
            c.completion(BASE + QUESTION, id_slot=0, cache_salt="tenant-a", **GREEDY)
            c.completion(other, id_slot=0, cache_salt="tenant-b", **GREEDY)  # slot 0's cells go to the host cache
            loaded = c.completion(BASE + "\nQuestion: vault 2?", id_slot=0, cache_salt="tenant-b", **GREEDY)
            n_prompt = len(c.prompt_tokens(BASE + "\nQuestion: vault 2?"))
            assert loaded["timings"]["prompt_n"] < n_prompt // 2, "the prompt did not come from the host cache"
            res = c.completion(BASE + QUESTION, share=Share(0), id_slot=1, cache_salt="tenant-b", **GREEDY)
        assert res["shared_prefix"]["status"] == "salt_mismatch", res["shared_prefix"]
    finally:
        s.stop()


# ------------------------------------------------------------------------------ the directory and its key, again
def test_a_symlinked_save_path_is_refused(patched_server_bin: Path, model_path: Path, tmp_path: Path) -> None:
    """``--slot-save-path link/``: lstat of a path ending in "/" follows the link, so it used to pass (issue 34)."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    s = start(patched_server_bin, model_path, tmp_path, server_args(tmp_path / "link"), "pool-security-symlink")
    try:
        with Client(s.url) as c:
            c.prime(BASE, POOL)
            with pytest.raises(HTTPError, match="symbolic link"):
                c.save_pool(POOL, "x.pkvpool")
        assert not (real / "x.pkvpool").exists()
    finally:
        s.stop()


def test_the_directory_and_the_key_are_checked_at_every_save_and_restore(
    patched_server_bin: Path, model_path: Path, tmp_path: Path
) -> None:
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    s = start(patched_server_bin, model_path, tmp_path, server_args(d), "pool-security-every-save")
    try:
        with Client(s.url) as c:
            c.prime(BASE, POOL)
            c.save_pool(POOL, "first.pkvpool")
            d.chmod(0o777)  # opened up after the server started
            with pytest.raises(HTTPError, match="writable by its group or by others"):
                c.save_pool(POOL, "second.pkvpool")
            with pytest.raises(HTTPError, match="writable by its group or by others"):
                c.restore_pool(POOL, "first.pkvpool")
            d.chmod(0o700)
            key = (d / KEY_FILE).read_bytes()
            (d / KEY_FILE).write_bytes(os.urandom(32))  # replaced under the server
            with pytest.raises(HTTPError, match="changed since the server started"):
                c.save_pool(POOL, "second.pkvpool")
            (d / KEY_FILE).write_bytes(key)
            c.save_pool(POOL, "second.pkvpool")
            c.restore_pool(POOL, "second.pkvpool")
        assert (d / "second.pkvpool").stat().st_size > 0
    finally:
        s.stop()


def test_the_engine_and_the_server_creating_the_key_at_once_agree_on_one(
    patched_server_bin: Path, model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine starts writing the key and stalls before a byte is written; a server starts on the directory
    meanwhile. Written in place (before issue 34) the server found an empty key and refused every pool file; now
    the key appears only whole (linked into place), the server creates it, and the engine takes the server's."""
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    stall, stalled = threading.Event(), threading.Event()
    real_fdopen = os.fdopen

    def slow_fdopen(fd: int, *args: Any, **kwargs: Any) -> Any:
        if KEY_FILE in os.readlink(f"/proc/self/fd/{fd}"):
            stalled.set()
            stall.wait(120)
        return real_fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", slow_fdopen)
    engine: dict[str, Any] = {}
    t = threading.Thread(target=lambda: engine.setdefault("key", pool_key(d)))
    t.start()
    assert stalled.wait(30)
    s = start(patched_server_bin, model_path, tmp_path, server_args(d), "pool-security-key-race")
    try:
        stall.set()
        t.join(30)
        monkeypatch.undo()
        with Client(s.url) as c:
            c.prime(BASE, POOL)
            c.save_pool(POOL, "raced.pkvpool")  # the server holds a usable key
        assert engine["key"] == (d / KEY_FILE).read_bytes()  # and it is the engine's too
        assert [p.name for p in d.iterdir() if p.name.startswith(KEY_FILE)] == [KEY_FILE]  # no temporary left
    finally:
        stall.set()
        s.stop()

"""Pool files (patch 0075): a reserved pool saved to a verified file and restored, on the real server.

A restored pool must be resident (upstream's own restore into an ordinary slot is reported as
"restored" while the next request recomputes everything, llama.cpp issue 26676) and must
share exactly like a primed one: ``hit``, and the same answers byte for byte. Every file the
server should refuse is refused with HTTP 400 naming the reason, with the pool untouched (a
bad file) or empty (a good file that does not fit), and the server keeps serving. A file not
written with the cache's key (forged, changed, truncated) is refused for its authentication; a
request with another salt than the pool's (or none) gets one fixed refusal with no detail.

Format 3 (issue 26): ``MAGIC``, u32 LE header length, JSON header, state, and a trailing
HMAC-SHA256 of everything before it keyed with the cache's secret (``.polykv-pool.key`` in the
save directory, 32 raw bytes, 0600). The tests that need a well-formed file with a field
changed sign it with that key (what only the server's user can do) to reach the checks after
the authentication.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import signal
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polykv_py.client import Client, Request, Share
from polykv_py.errors import HTTPError
from polykv_py.harness.answers import compare
from polykv_py.llama_server import LlamaServer
from polykv_py.pools import tokens_mac
from polykv_py.prefix_file import KEY_FILE, MAC_BYTES, MAGIC, read_prefix_header, tokens_sha256
from polykv_py.presets import NO_HOST_CACHE, UNIFIED_KV, pool_slot_args, slots_args

pytestmark = pytest.mark.integration

POOL, AGENTS = 0, (1, 2)
CTX = 4096
GREEDY: dict[str, Any] = {"temperature": 0, "n_predict": 8, "n_probs": 5, "cache_prompt": True}
BASE = "\n".join(
    f"Entry {i}: the ledger records {i * 13 % 97} crates of item {i} on pier {i % 7}, checked by clerk {i % 5}."
    for i in range(40)
)
#: The refusal of a request whose cache_salt is not the pool's (or is missing): the same for every cause.
SALT_REFUSAL = "the pool file does not match this request"
QUESTIONS = (
    "\nQuestion: how many crates does entry 12 record?\nAnswer:",
    "\nQuestion: which pier holds item 30?\nAnswer:",
)


def server_args(save: Path, *, unified: bool = True, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        *([UNIFIED_KV] if unified else []),
        *slots_args(3, CTX),
        *NO_HOST_CACHE,
        "--slots",
        "--slot-save-path",
        f"{save}/",
        *pool_slot_args([POOL]),
        *extra,
    ]


def start(bin_: Path, model: Path, logs: Path, args: list[str], name: str = "pool-files") -> LlamaServer:
    return LlamaServer(bin_, model, args, log_dir=logs, name=name, threads=2).start()


@pytest.fixture(scope="module")
def srv(patched_server_bin: Path, model_path: Path, save_dir: Path, logs: Path) -> Iterator[LlamaServer]:
    s = start(patched_server_bin, model_path, logs, server_args(save_dir))
    try:
        yield s
    finally:
        s.stop()


def answers(c: Client, share: bool = True) -> list[dict[str, Any]]:
    """The two agents' answers, one at a time, each on its own slot."""
    out = []
    for slot, q in zip(AGENTS, QUESTIONS, strict=True):
        c.erase_slot(slot)
        out.append(c.completion(BASE + q, share=Share(POOL) if share else None, id_slot=slot, **GREEDY))
    return out


def status_of(res: dict[str, Any]) -> str:
    return str(res["shared_prefix"]["status"])


def pool(c: Client) -> Any:
    (p,) = [p for p in c.pools() if p.slot == POOL]
    return p


@pytest.fixture(scope="module")
def saved(srv: LlamaServer, save_dir: Path) -> dict[str, Any]:
    """Prime the pool, record the sharers' answers, save the pool: ``{"tokens", "answers", "raw", "file"}``
    (``raw``: the whole answers). Every test of ``srv`` takes this first, so the pool is primed on the fresh
    server: its cells are [0, n), the sharers' follow, as on a fresh server that restores the file."""
    with Client(srv.url) as c:
        tokens = c.prompt_tokens(BASE)
        c.erase_slot(POOL)
        c.prime(tokens, POOL)
        first = answers(c)
        assert [status_of(a) for a in first] == ["hit", "hit"]
        res = c.save_pool(POOL, "base.pkvpool")
    assert res["n_saved"] == len(tokens) and res["polykv"]["tokens_sha256"] == tokens_sha256(tokens)
    assert res["n_written"] == (save_dir / "base.pkvpool").stat().st_size
    return {"tokens": tokens, "answers": [a["content"] for a in first], "raw": first, "file": save_dir / "base.pkvpool"}


def split_file(raw: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """(header, state, MAC trailer) of a format-3 pool file."""
    (n,) = struct.unpack("<I", raw[len(MAGIC) : len(MAGIC) + 4])
    header = json.loads(raw[len(MAGIC) + 4 : len(MAGIC) + 4 + n])
    return header, raw[len(MAGIC) + 4 + n : len(raw) - MAC_BYTES], raw[len(raw) - MAC_BYTES :]


def file_mac(key: bytes, body: bytes) -> bytes:
    """The trailer the server writes: HMAC-SHA256 of everything before it, keyed with the cache's key."""
    return hmac.new(key, body, hashlib.sha256).digest()


def first_difference(a: bytes, b: bytes) -> int | None:
    """The offset of the first byte where ``a`` and ``b`` differ (the shorter one's length if one is a prefix of
    the other), None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def resaved(c: Client, save_dir: Path, name: str) -> bytes:
    """The pool saved again, as ``name``: its file's bytes."""
    res = c.save_pool(POOL, name)
    assert res["n_written"] == (save_dir / name).stat().st_size
    return (save_dir / name).read_bytes()


#: Upstream's slot file (llama_state_seq_save_file): magic "ggsq", version, a count of 32-bit words and the words,
#: then the sequence's state (llama_state_seq_get_data's bytes after its own magic and sequence id).
GGSQ_MAGIC, GGSQ_VERSION = 0x67677371, 3
#: What llama_state_seq_get_data writes first (llama_context's io_magic), then the sequence id.
STATE_MAGIC = 0xAF143CD8


def upstream_slot_file(raw: bytes) -> tuple[list[int], bytes]:
    """(tokens, sequence state) of a file upstream's ``POST /slots/N?action=save`` wrote. Its words are the
    slot's tokens as server_tokens::serialize packs them: LLAMA_TOKEN_NULL, the packing's version (1), the
    token count and the tokens, then the count of media chunks (none here)."""
    magic, version, n_words = struct.unpack_from("<III", raw)
    assert (magic, version) == (GGSQ_MAGIC, GGSQ_VERSION), (hex(magic), version)
    words = list(struct.unpack_from(f"<{n_words}i", raw, 12))
    null, packing, n = words[:3]
    assert (null, packing, words[3 + n :]) == (-1, 1, [0]), words[:3] + words[3 + n :]
    return words[3 : 3 + n], raw[12 + 4 * n_words :]


def rewrite(src: Path, dst: Path, *, state: bytes | None = None, sign_with: Path | None = None, **changes: Any) -> None:
    """Copy a pool file with header fields changed (hashes left as they were unless changed too). The MAC is
    the old one (so the copy fails its authentication), or, with ``sign_with`` (a key file), a valid one."""
    header, old_state, old_mac = split_file(src.read_bytes())
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            header[section][field] = value
        else:
            header[key] = value
    new = json.dumps(header).encode()
    body = MAGIC + struct.pack("<I", len(new)) + new + (state if state is not None else old_state)
    dst.write_bytes(body + (file_mac(sign_with.read_bytes(), body) if sign_with is not None else old_mac))


def refused(c: Client, name: str, reason: str, **kw: Any) -> str:
    """Restore ``name`` expecting HTTP 400 whose message contains ``reason`` (a real fragment: never empty)."""
    assert reason, "refused() needs the fragment the refusal must contain ('' would match any message)"
    with pytest.raises(HTTPError) as err:
        c.restore_pool(POOL, name, **kw)
    assert err.value.status == 400
    assert reason in err.value.server_message, err.value.server_message
    return err.value.server_message


def salt_refused(c: Client, action: str, name: str, **kw: Any) -> None:
    """``action`` (save or restore) of pool file ``name`` is refused with the salt refusal and nothing else."""
    call = c.save_pool if action == "save" else c.restore_pool
    with pytest.raises(HTTPError) as err:
        call(POOL, name, **kw)
    assert err.value.status == 400
    assert err.value.server_message == f"Unable to {action} pool slot {POOL}: {SALT_REFUSAL}", err.value.server_message


# ------------------------------------------------------------------------------ restore
def test_restore_after_restart_is_resident_and_answers_the_same(
    srv: LlamaServer, saved: dict[str, Any], save_dir: Path
) -> None:
    srv.restart()
    with Client(srv.url) as c:
        assert not pool(c).resident
        t0 = time.perf_counter()
        res = c.restore_pool(POOL, "base.pkvpool", tokens=saved["tokens"])
        wall = time.perf_counter() - t0
        assert res["n_restored"] == len(saved["tokens"]) and res["polykv"]["resident"] is True
        st = pool(c)
        assert st.resident and st.n_tokens == len(saved["tokens"]) and st.restored_from == "base.pkvpool"
        # the restored KV, saved again, is the file byte for byte (header, state and MAC)
        at = first_difference(resaved(c, save_dir, "restored.pkvpool"), saved["file"].read_bytes())
        assert at is None, f"the restored pool, saved again, differs from its file from byte {at} on"
        again = answers(c)
        n_prompts = [len(c.prompt_tokens(BASE + q)) for q in QUESTIONS]
    assert [status_of(a) for a in again] == ["hit", "hit"]
    assert [a["timings"]["prompt_n"] for a in again] == [n - len(saved["tokens"]) for n in n_prompts], (
        "a restored pool's tokens were computed again"
    )
    # a fresh server in both runs: the pool's cells and the sharers' lie alike, so the answers are the same bytes
    for i, (now, then) in enumerate(zip(again, saved["raw"], strict=True)):
        same, where = compare(now, then)
        assert same, f"agent {AGENTS[i]}: the answer over the restored pool differs from the primed one's at {where}"
    assert [a["content"] for a in again] == saved["answers"]
    assert wall < 5.0


def test_listing_counts_hits_and_sharers(srv: LlamaServer, saved: dict[str, Any]) -> None:
    with Client(srv.url) as c:
        c.restore_pool(POOL, "base.pkvpool")
        before = pool(c)
        answers(c)
        after = pool(c)
        assert after.hits == before.hits + 2
        assert after.sharers == 2  # both agent slots still hold the pool's cells
        assert after.last_use_s_ago is not None and after.last_use_s_ago < 30
        assert after.salted is False and after.tokens_mac is None
        assert after.tokens_sha256 == tokens_sha256(saved["tokens"]) and after.holds(saved["tokens"])
        c.erase_slot(AGENTS[0])
        assert pool(c).sharers == 1
        assert c.pool_features().pool_files["model"]["sha256"] == hashlib.sha256(srv.model.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------ refusals
def test_bad_files_are_refused_and_change_nothing(srv: LlamaServer, saved: dict[str, Any], save_dir: Path) -> None:
    src: Path = saved["file"]
    raw = src.read_bytes()
    (save_dir / "truncated.pkvpool").write_bytes(raw[: len(raw) - 1000])
    flipped = bytearray(raw)
    flipped[-500] ^= 0xFF
    (save_dir / "flipped.pkvpool").write_bytes(bytes(flipped))
    (save_dir / "not-ours.pkvpool").write_bytes(b"ggsq" + bytes(200))
    key = save_dir / KEY_FILE
    rewrite(src, save_dir / "forged-model.pkvpool", model__sha256="0" * 64)  # no key: cannot sign
    rewrite(src, save_dir / "other-model.pkvpool", model__sha256="0" * 64, sign_with=key)
    rewrite(src, save_dir / "other-kv.pkvpool", kv__type_k="q8_0", sign_with=key)
    bad_tokens = [*saved["tokens"][:-1], 10**7]
    rewrite(src, save_dir / "vocab.pkvpool", tokens=bad_tokens, tokens_sha256=tokens_sha256(bad_tokens), sign_with=key)
    with Client(srv.url) as c:
        c.restore_pool(POOL, "base.pkvpool")
        cases = {
            "truncated.pkvpool": "authentication failed",
            "flipped.pkvpool": "authentication failed",
            "forged-model.pkvpool": "authentication failed",
            "not-ours.pkvpool": "bad magic",
            "other-model.pkvpool": "saved from another model (differs in sha256)",
            "other-kv.pkvpool": "another KV layout (differs in type_k",
            "vocab.pkvpool": "not in this model's vocabulary",
            "missing.pkvpool": "no such file",
        }
        for name, reason in cases.items():
            refused(c, name, reason)
        refused(c, "base.pkvpool", "other tokens than expected", tokens=saved["tokens"][:-1])
        refused(c, "base.pkvpool", "first difference at 3", tokens=[*saved["tokens"][:3], 7, *saved["tokens"][4:]])
        salt_refused(c, "restore", "base.pkvpool", cache_salt="team-a")  # an unsalted file, a salted request
        for body, reason in (
            ({"tokens": "abc"}, "tokens"),
            ({"cache_salt": 5}, "cache_salt"),
            ({"tokens_sha256": "xyz"}, "tokens_sha256"),
            ({"promoted": "yes"}, "promoted"),
        ):
            with pytest.raises(HTTPError, match=reason) as err:
                c.send(Request.post(f"/slots/{POOL}?action=restore", {"filename": "base.pkvpool", **body}))
            assert err.value.status == 400
        # a save that names the tokens it expects (polykv serve saving a promoted pool) is refused for others
        with pytest.raises(HTTPError, match="holds other tokens than expected") as err:
            c.save_pool(POOL, "changed.pkvpool", sha256_of_tokens=tokens_sha256(saved["tokens"][:-1]))
        assert err.value.status == 400 and not (save_dir / "changed.pkvpool").exists()
        # the pool was never touched: still resident, its KV the file's byte for byte, sharers hit with the same answers
        assert pool(c).resident and pool(c).restored_from == "base.pkvpool"
        at = first_difference(resaved(c, save_dir, "untouched.pkvpool"), raw)
        assert at is None, f"the pool, saved again, differs from the file it was restored from from byte {at} on"
        again = answers(c)
    assert [status_of(a) for a in again] == ["hit", "hit"]
    assert [a["content"] for a in again] == saved["answers"]


def test_salted_pool_needs_its_salt(srv: LlamaServer, saved: dict[str, Any]) -> None:
    with Client(srv.url) as c:
        c.erase_slot(POOL)
        c.prime(saved["tokens"], POOL, cache_salt="team-a")
        salt_refused(c, "save", "salted.pkvpool")  # saving (or overwriting) a salted pool needs its salt
        salt_refused(c, "save", "salted.pkvpool", cache_salt="team-b")
        res = c.save_pool(POOL, "salted.pkvpool", cache_salt="team-a")
        salt_hash = hashlib.sha256(b"team-a").hexdigest()
        assert res["polykv"]["salted"] is True and "salt_sha256" not in res["polykv"]
        assert salt_hash not in json.dumps(res), "an unkeyed hash of the salt lets anyone test a guess"
        header = read_prefix_header(saved["file"].with_name("salted.pkvpool"))
        assert "team-a" not in json.dumps(header), "the salt itself must not be written"
        assert salt_hash not in json.dumps(header), "nor its unkeyed hash"
        salt_refused(c, "restore", "salted.pkvpool")
        salt_refused(c, "restore", "salted.pkvpool", cache_salt="team-b")
        # the salt is checked first: wrong tokens under a wrong salt learn nothing about the file's tokens
        salt_refused(c, "restore", "salted.pkvpool", cache_salt="team-b", tokens=saved["tokens"][:-1])
        salt_refused(c, "restore", "salted.pkvpool", tokens=[*saved["tokens"][:3], 7, *saved["tokens"][4:]])
        c.restore_pool(POOL, "salted.pkvpool", cache_salt="team-a")
        st = pool(c)
        assert st.resident and st.salted is True
        assert st.n_tokens is None and st.tokens_sha256 is None and st.restored_from is None, "hidden when salted"
        assert st.tokens_mac == tokens_mac(saved["tokens"], "team-a")
        assert st.holds(saved["tokens"], "team-a") and not st.holds(saved["tokens"], "team-b")
        assert not st.holds(saved["tokens"]) and salt_hash not in json.dumps(c.slots())
        c.erase_slot(AGENTS[0])
        salted = c.completion(BASE + QUESTIONS[0], share=Share(POOL), id_slot=AGENTS[0], cache_salt="team-a", **GREEDY)
        c.erase_slot(AGENTS[0])
        unsalted = c.completion(BASE + QUESTIONS[0], share=Share(POOL), id_slot=AGENTS[0], **GREEDY)
    assert status_of(salted) == "hit" and salted["content"] == saved["answers"][0]
    assert status_of(unsalted) == "salt_mismatch"  # computed alone: its own cell layout, so no byte comparison


def test_file_that_does_not_fit_leaves_the_pool_empty(
    patched_server_bin: Path, model_path: Path, saved: dict[str, Any], save_dir: Path, tmp_path: Path
) -> None:
    """A verified file with no room for its cells: refused, the pool empty (not half-loaded), the server serving."""
    n = len(saved["tokens"])
    small = start(
        patched_server_bin, model_path, tmp_path, [*server_args(save_dir), "-c", str(n + 600)], "pool-files-small"
    )
    try:
        with Client(small.url) as c:
            filler = " ".join(f"w{i}" for i in range(2000))
            c.prime(c.prompt_tokens(filler)[: n // 2 + 300], AGENTS[0])  # the agent slots hold most cells
            c.prime(c.prompt_tokens("x " + filler)[: n // 2 + 300], AGENTS[1])
            msg = refused(c, "base.pkvpool", "no room")
            assert str(n) in msg
            assert not pool(c).resident
            c.erase_slot(AGENTS[0])
            c.erase_slot(AGENTS[1])
            c.restore_pool(POOL, "base.pkvpool")
            res = c.completion(BASE + QUESTIONS[0], share=Share(POOL), id_slot=AGENTS[0], **GREEDY)
        assert status_of(res) == "hit" and res["content"] == saved["answers"][0]
    finally:
        small.stop()


def test_other_stream_layout_is_refused(
    patched_server_bin: Path, model_path: Path, saved: dict[str, Any], save_dir: Path, tmp_path: Path
) -> None:
    """A file saved with unified KV, restored on a server with one KV stream per slot."""
    split = start(patched_server_bin, model_path, tmp_path, server_args(save_dir, unified=False), "pool-files-split")
    try:
        with Client(split.url) as c:
            refused(c, "base.pkvpool", "another KV layout (differs in n_stream")
            assert not pool(c).resident
            assert c.completion("Hello", n_predict=2)["content"] is not None
    finally:
        split.stop()


#: Attempts at killing a save mid-write, each at a later point of the write (the fraction of the final size the
#: partial file must have reached): the test fails unless at least one kill is proven to land mid-write.
KILL_AT = (0.0, 0.25, 0.5, 0.0, 0.1, 0.75)


@pytest.mark.slow  # up to 6 servers started and killed mid-save, then a fresh one restores what they left
def test_killed_save_never_leaves_a_file_a_restore_accepts(
    patched_server_bin: Path, model_path: Path, saved: dict[str, Any], tmp_path: Path
) -> None:
    """SIGKILL the server while it writes a save: whatever is left under the name is whole or absent, and the
    partial file is refused (or, written completely but never renamed, restored as the valid file it is).

    The kill must be shown to land mid-write, else the test proves nothing: the partial file is watched until
    it exists and is smaller than the file a completed save writes, the server is killed at once, and the
    attempt counts only when afterwards the partial file is still there, short, and the name was never
    written. Attempts go on (each killing at a later point of the write) until one is caught; none: a failure.
    """
    save = tmp_path / "saves"
    save.mkdir(mode=0o700)
    long_base = " ".join(f"token{i}" for i in range(1500))
    outcomes: list[str] = []
    full_size = 0
    for i, at in enumerate(KILL_AT):
        s = start(patched_server_bin, model_path, tmp_path, server_args(save), "pool-files-kill")
        name = f"killed-{i}.pkvpool"
        seen: tuple[int, int] | None = None  # (size of the partial file when the kill was sent, the final size)
        try:
            with Client(s.url) as c:
                c.prime(c.prompt_tokens(long_base)[:1500], POOL)
                if not full_size:  # what a completed save of this pool writes
                    full_size = int(c.save_pool(POOL, "reference.pkvpool")["n_written"])
                    assert full_size == (save / "reference.pkvpool").stat().st_size
                errors: list[BaseException] = []
                t = threading.Thread(target=_try, args=(lambda c=c, name=name: c.save_pool(POOL, name), errors))
                t.start()
                seen = _kill_mid_write(s.pid, save, name, min_bytes=int(at * full_size), full_size=full_size)
                t.join(timeout=30)  # None: the save completed before it was seen mid-write (nothing was killed)
        finally:
            s.stop()
        f = save / name
        parts = sorted(save.glob(f"{name}.part.*"))
        caught = (
            seen is not None
            and not f.exists()
            and len(parts) == 1
            and seen[0] < full_size
            and parts[0].stat().st_size < full_size
        )
        outcomes.append(
            f"kill at >= {at:.0%}: " + (f"caught mid-write at {seen[0]} of {full_size} bytes" if caught else "missed")
        )
        if f.exists():  # the rename happened: the file must be complete
            assert is_whole(f, save / KEY_FILE), f"{name} exists but is not whole"
        if caught and sum("caught" in o for o in outcomes) >= 2:
            break
    logging.getLogger(__name__).info("killed saves: %s", outcomes)
    assert any("caught" in o for o in outcomes), f"no kill landed while a save was writing: {outcomes}"

    # whatever a killed save left besides (a ".part.<pid>" file) is refused by a restore unless the kill
    # came after it was completely written (then it is a valid file, only never renamed)
    s = start(patched_server_bin, model_path, tmp_path, server_args(save), "pool-files-after-kill")
    try:
        with Client(s.url) as c:
            for part in sorted(save.glob("*.part.*")):
                if is_whole(part, save / KEY_FILE):
                    c.restore_pool(POOL, part.name)
                    assert pool(c).resident
                else:
                    refused(c, part.name, partial_refusal(part.read_bytes()))
            for whole in sorted(save.glob("killed-*.pkvpool")):
                c.restore_pool(POOL, whole.name)
                assert pool(c).resident
    finally:
        s.stop()


def _kill_mid_write(pid: int, save: Path, name: str, *, min_bytes: int, full_size: int) -> tuple[int, int] | None:
    """Watch for the partial file of ``name``'s save; as soon as it holds at least ``min_bytes`` and less than
    ``full_size``, SIGKILL ``pid`` and return (its size then, ``full_size``). None when the save completed (or
    20 s passed) without the partial file ever being seen in that range (nothing killed then)."""
    deadline = time.monotonic() + 20.0
    final = save / name
    while time.monotonic() < deadline:
        for part in save.glob(f"{name}.part.*"):
            try:
                size = part.stat().st_size
            except FileNotFoundError:  # renamed just now
                continue
            if min_bytes <= size < full_size and size > 0:
                os.kill(pid, signal.SIGKILL)
                return size, full_size
        if final.exists():
            return None
    return None


def partial_refusal(raw: bytes) -> str:
    """What a restore of a partial file says: too short to hold the magic and header length is a bad magic;
    anything longer that is not the whole file fails its authentication (its last 32 bytes are no valid MAC)."""
    if len(raw) < len(MAGIC) + 4 or raw[: len(MAGIC)] != MAGIC:
        return "bad magic"
    return "authentication failed"


def is_whole(f: Path, key_file: Path) -> bool:
    """True when a pool file is complete: its MAC (keyed with the cache's key) matches and its state has the
    size its header names."""
    raw = f.read_bytes()
    if len(raw) < len(MAGIC) + 4 + MAC_BYTES or raw[: len(MAGIC)] != MAGIC:
        return False
    if not hmac.compare_digest(file_mac(key_file.read_bytes(), raw[:-MAC_BYTES]), raw[-MAC_BYTES:]):
        return False
    header, state, _ = split_file(raw)
    return len(state) == header["state_bytes"]


def _try(call: Any, errors: list[BaseException]) -> None:
    try:
        call()
    except Exception as exc:  # the server is killed under the request
        errors.append(exc)


# ------------------------------------------------------------------------------ the reference's KV
def test_pool_file_holds_the_reference_servers_kv(
    upstream_server_bin: Path, model_path: Path, saved: dict[str, Any], tmp_path: Path
) -> None:
    """The pool file's state is, byte for byte, what the reference server computes for the same tokens: a
    fresh reference server (same KV flags, no pool) primes slot 0 with the pool's tokens and saves the slot with
    upstream's own action; its state equals the file's after llama_state_seq_get_data's magic and sequence id
    (both servers put the prefix in cells [0, n) of an empty cache, with the same batches)."""
    ref_dir = tmp_path / "reference-slots"
    ref_dir.mkdir(mode=0o700)
    args = [UNIFIED_KV, *slots_args(3, CTX), *NO_HOST_CACHE, "--slots", "--slot-save-path", f"{ref_dir}/"]
    with start(upstream_server_bin, model_path, tmp_path, args, "pool-files-reference") as ref, Client(ref.url) as c:
        c.prime(saved["tokens"], POOL)
        res = c.post_json(f"/slots/{POOL}?action=save", {"filename": "slot0.bin"})
    assert res["n_saved"] == len(saved["tokens"])
    ref_tokens, ref_state = upstream_slot_file((ref_dir / "slot0.bin").read_bytes())
    header, state, _ = split_file(saved["file"].read_bytes())
    assert ref_tokens == header["tokens"] == saved["tokens"]
    assert struct.unpack_from("<Ii", state) == (STATE_MAGIC, POOL)
    at = first_difference(state[8:], ref_state)
    assert at is None, f"the pool's KV differs from the reference's from byte {at} of {len(ref_state)} on"


# ------------------------------------------------------------------------------ one format, two faces
def test_engine_and_server_read_each_others_files(srv: LlamaServer, saved: dict[str, Any], save_dir: Path) -> None:
    """The in-process engine restores the server's file, and the server restores the engine's."""
    from polykv_py.llama import Model

    tokens = saved["tokens"]
    with (
        Model(srv.model, n_gpu_layers=0) as m,
        m.context(
            n_ctx=CTX, n_seq_max=3, kv_unified=True, flash_attn="on", n_threads=2, n_ubatch=512, n_batch=2048
        ) as ctx,
    ):
        assert ctx.load_prefix(saved["file"], 0, expected_tokens=tokens) == tokens
        assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (0, len(tokens) - 1)
        ctx.memory.seq_rm(0)
        ctx.decode_tokens(tokens, seq_id=0, logits_last=False)
        ctx.save_prefix(save_dir / "engine.pkvpool", 0, tokens)
    engine_header = read_prefix_header(save_dir / "engine.pkvpool")
    server_header = read_prefix_header(saved["file"])
    assert engine_header["model"] == server_header["model"] and engine_header["kv"] == server_header["kv"]
    with Client(srv.url) as c:
        res = c.restore_pool(POOL, "engine.pkvpool", tokens=tokens)
        assert res["polykv"]["resident"]
        again = answers(c)
    assert [status_of(a) for a in again] == ["hit", "hit"]
    # the same kernels and batch sizes on the same machine: the engine computed the server's KV bit for bit
    engine_state = split_file((save_dir / "engine.pkvpool").read_bytes())[1]
    assert engine_state == split_file(saved["file"].read_bytes())[1]
    assert [a["content"] for a in again] == saved["answers"]

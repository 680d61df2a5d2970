"""A saved prefix survives restarts, and a foreign or damaged one is refused."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import struct
from pathlib import Path

import pytest
from memory_data import THREADS

from polykv_py.engine import GenerationParams, SharedPrefixEngine
from polykv_py.errors import StateError
from polykv_py.llama import ContextParams, Model
from polykv_py.prefix_file import KEY_FILE, MAC_BYTES, MAGIC, pool_key

pytestmark = pytest.mark.integration

BASE = ContextParams(n_threads=THREADS, n_ubatch=32, flash_attn="on")
GREEDY = GenerationParams(max_tokens=6)


def _engine(model: Model, **kw: object) -> SharedPrefixEngine:
    return SharedPrefixEngine(model, SharedPrefixEngine.context_params(2, 200, 20, 6, base=BASE), **kw)


@pytest.fixture(scope="module")
def saved(
    model: Model, prefix_tokens: list[int], suffix_tokens: list[list[int]], tmp_path_factory: pytest.TempPathFactory
):
    """(path, first run) from an engine that is closed before anyone loads the file."""
    path = tmp_path_factory.mktemp("prefix") / "prefix.pkv"
    with _engine(model) as eng:
        first = eng.run(prefix_tokens, suffix_tokens[:2], GREEDY)
        eng.save_prefix(path)
    return path, first


def _rewrite_header(src: Path, dst: Path, *, key: bytes | None = None, **changes: object) -> None:
    """Copy a prefix file with header fields changed, MACed with ``key`` (None: no valid MAC, as a forger
    without the directory's key would write it)."""
    raw = src.read_bytes()[:-MAC_BYTES]
    (n,) = struct.unpack("<I", raw[len(MAGIC) : len(MAGIC) + 4])
    header = json.loads(raw[len(MAGIC) + 4 : len(MAGIC) + 4 + n])
    for field, value in changes.items():
        if field == "model_sha256":
            header["model"]["sha256"] = value
        else:
            header[field] = value
    new = json.dumps(header).encode()
    body = MAGIC + struct.pack("<I", len(new)) + new + raw[len(MAGIC) + 4 + n :]
    tag = hmac.new(key, body, hashlib.sha256).digest() if key else hashlib.sha256(body).digest()
    dst.write_bytes(body + tag)


def test_prefix_survives_a_fresh_context(
    saved, model: Model, prefix_tokens: list[int], suffix_tokens: list[list[int]]
) -> None:
    path, first = saved
    with _engine(model) as eng:
        assert eng.load_prefix(path, expected_tokens=prefix_tokens) == prefix_tokens
        assert (eng.ctx.memory.seq_pos_min(0), eng.ctx.memory.seq_pos_max(0)) == (0, len(prefix_tokens) - 1)
        assert eng.ctx.memory.cells_in_use() == len(prefix_tokens)
        res = eng.run(prefix_tokens, suffix_tokens[:2], GREEDY)
    assert res.prefix_reused
    assert res.tokens_processed == sum(len(a.suffix_tokens) + len(a.tokens) for a in res.agents), (
        "prefix not recomputed"
    )
    assert [a.tokens for a in res.agents] == [a.tokens for a in first.agents]


def test_wrong_token_list_is_refused(saved, model: Model, prefix_tokens: list[int]) -> None:
    path, _ = saved
    with _engine(model) as eng:
        with pytest.raises(StateError, match="another token list"):
            eng.load_prefix(path, expected_tokens=[*prefix_tokens[:-1], prefix_tokens[-1] + 1])
        with pytest.raises(StateError, match="another token list"):
            eng.load_prefix(path, expected_tokens=prefix_tokens[:-1])
        assert eng.ctx.memory.seq_pos_max(0) == -1 and eng.prefix_tokens is None


def test_other_model_is_refused(saved, model: Model) -> None:
    path, _ = saved
    other = path.with_name("other-model.pkv")
    _rewrite_header(path, other, key=pool_key(path.parent, create=False), model_sha256="0" * 64)
    with _engine(model) as eng, pytest.raises(StateError, match="another model"):
        eng.load_prefix(other)


def test_damaged_or_foreign_files_are_refused(saved, model: Model, tmp_path: Path) -> None:
    path, _ = saved
    key = pool_key(path.parent, create=False)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    damaged = path.with_name("damaged.pkv")
    damaged.write_bytes(bytes(raw))
    not_ours = path.with_name("raw.bin")
    not_ours.write_bytes(b"GGSQ" + b"\0" * 100)
    forged = path.with_name("forged.pkv")
    _rewrite_header(path, forged, tokens=[1, 2, 3])  # no key: what someone who can only write the directory makes
    tampered = path.with_name("tampered.pkv")
    _rewrite_header(path, tampered, key=key, tokens=[1, 2, 3])  # a key holder's inconsistent file
    elsewhere = tmp_path / "copy.pkv"  # the genuine file in a directory with no key
    shutil.copy(path, elsewhere)
    with _engine(model) as eng:
        for f in (damaged, forged):
            with pytest.raises(StateError, match="authentication failed"):
                eng.load_prefix(f)
        with pytest.raises(StateError, match="magic"):
            eng.load_prefix(not_ours)
        with pytest.raises(StateError, match="damaged"):
            eng.load_prefix(tampered)
        with pytest.raises(StateError, match=f"no pool key \\({KEY_FILE}\\)"):
            eng.load_prefix(elsewhere)
        with pytest.raises(StateError):
            eng.load_prefix(path.with_name("missing.pkv"))
        assert eng.ctx.memory.seq_pos_max(0) == -1


def test_incompatible_contexts_are_refused(saved, model: Model, prefix_tokens: list[int]) -> None:
    path, _ = saved
    with _engine(model, kv_unified=False) as eng, pytest.raises(StateError, match="stream"):
        eng.load_prefix(path)
    with model.context(BASE, n_ctx=256, n_seq_max=2) as ctx:
        ctx.decode_tokens((prefix_tokens * 2)[:200], seq_id=1, logits_last=False)  # leaves 56 free cells
        with pytest.raises(StateError, match="free KV cells"):
            ctx.load_prefix(path, 0)
        assert ctx.memory.seq_pos_max(0) == -1 and ctx.memory.seq_pos_max(1) == 199


def test_save_requires_matching_tokens(model: Model, prefix_tokens: list[int], tmp_path: Path) -> None:
    with model.context(BASE, n_ctx=512) as ctx:
        ctx.decode_tokens(prefix_tokens, seq_id=0, logits_last=False)
        with pytest.raises(StateError, match="holds positions"):
            ctx.save_prefix(tmp_path / "x.pkv", 0, prefix_tokens[:-1])
        with pytest.raises(StateError, match="empty"):
            ctx.save_prefix(tmp_path / "x.pkv", 0, [])
        ctx.memory.seq_rm(0, 20, 30)
        ctx.memory.seq_add(0, 30, -1, -10)  # the prefix's positions are [0, n - 11]: shifted cells
        ctx.decode_tokens(prefix_tokens[-10:], seq_id=0, pos0=len(prefix_tokens) - 10, logits_last=False)
        with pytest.raises(StateError, match="not exact"):
            ctx.save_prefix(tmp_path / "x.pkv", 0, prefix_tokens)
        assert not (tmp_path / "x.pkv").exists()

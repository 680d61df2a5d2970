"""The memory API over the real default model: positions, KV cells, state, and bad input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from polykv_py.errors import ContextFullError, LlamaError, ModelError, SequenceError, StateError, TokenError
from polykv_py.llama import Batch, Context, Model, Sampler

pytestmark = pytest.mark.integration

MakeCtx = Callable[..., Context]


def _decode_suffixes(ctx: Context, prefix_len: int, suffixes: list[list[int]], first_seq: int = 1) -> None:
    """Decode every suffix into its own sequence (first_seq, first_seq+1, ...) in one batch."""
    with Batch(sum(len(s) for s in suffixes)) as b:
        for i, suf in enumerate(suffixes):
            b.add_sequence(suf, prefix_len, first_seq + i, logits_last=True)
        ctx.decode(b)


# -- vocab ---------------------------------------------------------------------------
def test_tokenize_roundtrip_and_specials(model: Model) -> None:
    text = "Hello, world! Ünïcödé and emoji 🙂."
    toks = model.tokenize(text)
    assert toks and all(0 <= t < model.vocab.n_tokens for t in toks)
    assert model.detokenize(toks) == text
    v = model.vocab
    assert v.is_eog(v.eos)
    im_end = model.tokenize("<|im_end|>", add_special=False, parse_special=True)
    assert len(im_end) == 1 and v.is_eog(im_end[0])
    assert model.detokenize(im_end, unparse_special=True) == "<|im_end|>"
    assert v.token_to_piece(toks[0]) == text.encode()[: len(v.token_to_piece(toks[0]))]
    assert isinstance(v.bos, int) and isinstance(v.add_bos, bool) and v.nl == model.tokenize("\n", add_special=False)[0]


def test_model_shape_and_exports(model: Model) -> None:
    from polykv_py import llama

    arch = model.meta("general.architecture")
    assert model.meta(f"{arch}.block_count") == str(model.n_layer)
    assert model.meta(f"{arch}.embedding_length") == str(model.n_embd)
    assert model.n_params > 0 and model.size > 0 and model.n_ctx_train > 0
    assert model.fingerprint()["n_layer"] == model.n_layer
    for name in llama.__all__:
        assert getattr(llama, name).__module__.startswith("polykv_py.llama."), name


def test_chat_template(model: Model) -> None:
    out = model.vocab.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], add_assistant=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in out and out.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="needs 'role'"):
        model.vocab.apply_chat_template([{"content": "no role"}])


def test_bad_tokens(model: Model) -> None:
    with pytest.raises(TokenError):
        model.detokenize([model.vocab.n_tokens])
    with pytest.raises(TokenError):
        model.vocab.is_eog(-1)


# -- positions and cells ----------------------------------------------------------------
def test_positions_and_cells_prefix_share_rm(
    make_context: MakeCtx, prefix_tokens: list[int], suffix_tokens: list[list[int]]
) -> None:
    ctx = make_context(n_ctx=1024, n_seq_max=5)
    mem = ctx.memory
    p = len(prefix_tokens)
    assert mem.cells_in_use() == 0
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (-1, -1)

    ctx.decode_tokens(prefix_tokens, seq_id=0, logits_last=False)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (0, p - 1)
    assert mem.cells_in_use() == p

    for s in range(1, 5):
        mem.seq_cp(0, s)
        assert (mem.seq_pos_min(s), mem.seq_pos_max(s)) == (0, p - 1)
    usage = mem.usage()
    assert usage.cells == p, "unified seq_cp must not add cells"
    assert usage.seq_refs == 5 * p

    _decode_suffixes(ctx, p, suffix_tokens)
    for s, suf in enumerate(suffix_tokens, start=1):
        assert (mem.seq_pos_min(s), mem.seq_pos_max(s)) == (0, p + len(suf) - 1)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (0, p - 1)
    total_suffix = sum(len(s) for s in suffix_tokens)
    assert mem.cells_in_use() == p + total_suffix, "cells grow by the suffixes only"

    mem.seq_rm(1, p, -1)  # drop agent 1's suffix
    assert (mem.seq_pos_min(1), mem.seq_pos_max(1)) == (0, p - 1)
    assert mem.cells_in_use() == p + total_suffix - len(suffix_tokens[0])
    assert mem.seq_len(2) == p + len(suffix_tokens[1])

    mem.seq_rm(1)  # the whole sequence: shared cells stay for the others
    assert mem.seq_pos_max(1) == -1
    assert mem.cells_in_use() == p + total_suffix - len(suffix_tokens[0])

    mem.seq_keep(2)
    assert mem.seq_pos_max(0) == -1 and mem.seq_pos_max(3) == -1
    assert mem.cells_in_use() == p + len(suffix_tokens[1])

    mem.clear()
    assert mem.cells_in_use() == 0


def test_seq_add_shifts_positions(make_context: MakeCtx, prefix_tokens: list[int]) -> None:
    ctx = make_context(n_ctx=512, n_seq_max=2)
    ctx.decode_tokens(prefix_tokens[:40], seq_id=0, logits_last=False)
    ctx.memory.seq_rm(0, 0, 10)
    assert ctx.memory.seq_pos_min(0) == 10
    ctx.memory.seq_add(0, 10, -1, -10)
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (0, 29)
    idx = ctx.decode_tokens(prefix_tokens[40:41], seq_id=0)  # positions continue after the shift
    assert idx is not None and ctx.memory.seq_pos_max(0) == 30


def test_exactness_follows_shifts_copies_removals_and_loads(make_context: MakeCtx, prefix_tokens: list[int]) -> None:
    """The record the engine shares by (issue 34): a shift, a hole or a raw load makes cells inexact, a copy carries
    the source's record, removing the inexact tail makes a sequence exact again."""
    ctx = make_context(n_ctx=512, n_seq_max=4)
    mem, everything = ctx.memory, 2**31 - 1
    ctx.decode_tokens(prefix_tokens[:40], seq_id=0, logits_last=False)
    assert mem.exact_len(0) == everything
    mem.seq_rm(0, 10, 20)  # a hole: the cells after it were computed over removed ones
    assert mem.exact_len(0) == 10
    mem.seq_add(0, 20, -1, -10)
    assert mem.exact_len(0) == 10 and mem.seq_pos_range(0) == (0, 29)
    mem.seq_cp(0, 1)
    assert mem.exact_len(1) == 10  # the copy is as inexact as its source
    mem.seq_cp(0, 2, 5, 8)  # a range not starting at 0: computed over cells seq 2 does not hold
    assert mem.exact_len(2) == 5
    mem.seq_rm(1, 10, -1)  # everything from the first inexact cell on: exact again
    assert mem.exact_len(1) == everything
    state = ctx.seq_state_bytes(1)
    ctx.set_seq_state_bytes(state, 3)  # raw bytes of unknown origin
    assert mem.exact_len(3) == 0
    with pytest.raises(SequenceError):
        mem.seq_add(9, 0, 1, 1)  # refused: the record does not change either
    assert mem.exact_len(0) == 10
    mem.clear()
    assert all(mem.exact_len(s) == everything for s in range(4))


def test_shared_logits_equal_own_logits(make_context: MakeCtx, prefix_tokens: list[int]) -> None:
    """A sequence sharing the prefix via seq_cp sees the same logits as the owner."""
    ctx = make_context(n_ctx=512, n_seq_max=2)
    ctx.decode_tokens(prefix_tokens, seq_id=0, logits_last=False)
    ctx.memory.seq_cp(0, 1)
    p = len(prefix_tokens)
    with Batch(2) as b:
        i0 = b.add(prefix_tokens[0], p, 0, True)
        i1 = b.add(prefix_tokens[0], p, 1, True)
        ctx.decode(b)
    assert ctx.logits(i0) == ctx.logits(i1)


# -- non-unified KV -------------------------------------------------------------------
def test_non_unified_refuses_partial_copy_and_copies_whole(
    make_context: MakeCtx, prefix_tokens: list[int], suffix_tokens: list[list[int]]
) -> None:
    ctx = make_context(n_ctx=1024, n_seq_max=3, kv_unified=False)
    p = len(prefix_tokens)
    ctx.decode_tokens(prefix_tokens, seq_id=0, logits_last=False)
    with pytest.raises(SequenceError, match="whole sequence"):
        ctx.memory.seq_cp(0, 1, 0, p)  # libllama would abort here
    with pytest.raises(SequenceError):
        ctx.memory.seq_cp(0, 1, 5, -1)
    ctx.memory.seq_cp(0, 1)  # whole sequence: a real copy into seq 1's stream
    assert ctx.memory.seq_pos_range(1) == (0, p - 1)
    assert ctx.memory.pending_copies == {1}
    with pytest.raises(LlamaError, match="pending"):
        ctx.memory.usage()  # the data copy happens at the next decode
    with pytest.raises(StateError, match="pending"):
        ctx.seq_state_bytes(1)
    _decode_suffixes(ctx, p, suffix_tokens[:1])
    assert not ctx.memory.pending_copies, "a decode carries out the pending copies"
    usage = ctx.memory.usage()
    assert usage.cells == 2 * p + len(suffix_tokens[0])
    assert usage.cells_of(1) == p + len(suffix_tokens[0])
    with Batch(2, max_seqs_per_token=2) as b:
        b.add(prefix_tokens[0], p + len(suffix_tokens[0]), (1, 2), True)
        with pytest.raises(SequenceError, match="several sequences"):
            ctx.decode(b)


# -- bad input -------------------------------------------------------------------------
def test_sequence_ids_out_of_range(make_context: MakeCtx, prefix_tokens: list[int]) -> None:
    ctx = make_context(n_ctx=256, n_seq_max=2)
    mem = ctx.memory
    ops = [
        lambda: mem.seq_rm(2),
        lambda: mem.seq_rm(-2),
        lambda: mem.seq_cp(0, 2),
        lambda: mem.seq_cp(5, 0),
        lambda: mem.seq_keep(2),
        lambda: mem.seq_add(2, 0, -1, 1),
        lambda: mem.seq_pos_min(2),
        lambda: mem.seq_pos_max(-1),
        lambda: ctx.decode_tokens(prefix_tokens[:4], seq_id=2),
        lambda: ctx.seq_state_bytes(7),
    ]
    for op in ops:
        with pytest.raises(SequenceError, match="out of range"):
            op()
    with Batch(4) as b:
        b.add(prefix_tokens[0], 0, 3, True)
        with pytest.raises(SequenceError, match="n_seq_max"):
            ctx.decode(b)
    with pytest.raises(SequenceError):
        mem.seq_rm(0, 10, 5)  # reversed range
    with pytest.raises(SequenceError):
        mem.seq_rm(True)  # type: ignore[arg-type]
    mem.seq_rm(-1)  # -1 means every sequence and is allowed


def test_bad_batches(make_context: MakeCtx, model: Model, prefix_tokens: list[int]) -> None:
    ctx = make_context(n_ctx=256, n_batch=64, n_seq_max=1)
    with Batch(4) as b, pytest.raises(LlamaError, match="empty"):
        ctx.decode(b)
    with Batch(100) as b:
        b.add_sequence(prefix_tokens[:65], 0, 0)
        with pytest.raises(LlamaError, match="n_batch"):
            ctx.decode(b)
    with Batch(4) as b:
        b.add(model.vocab.n_tokens, 0, 0)
        with pytest.raises(TokenError):
            ctx.decode(b)
    with Batch(2) as b:
        b.add(1, 0, 0)
        b.add(2, 1, 0)
        with pytest.raises(LlamaError, match="full"):
            b.add(3, 2, 0)
    with pytest.raises(SequenceError):
        Batch(2).add(1, -1, 0)
    ctx.decode_tokens(prefix_tokens[:10], seq_id=0)
    with Batch(2) as b:
        b.add(prefix_tokens[10], 20, 0, True)  # gap in positions: libllama returns -1
        with pytest.raises(LlamaError, match="invalid"):
            ctx.decode(b)
    assert ctx.memory.seq_pos_max(0) == 9
    with pytest.raises(LlamaError, match="no logits"):
        ctx.logits(0)
    with pytest.raises(TokenError):
        ctx.decode_tokens([])


def test_full_context_is_an_exception(make_context: MakeCtx, prefix_tokens: list[int]) -> None:
    ctx = make_context(n_ctx=256, n_seq_max=2)
    ctx.decode_tokens(prefix_tokens, seq_id=0, logits_last=False)
    before = ctx.memory.cells_in_use()
    with Batch(128) as b:
        b.add_sequence(prefix_tokens[:100], 0, 1, logits_last=True)
        with pytest.raises(ContextFullError):
            ctx.decode(b)
    assert ctx.memory.cells_in_use() == before, "a failed decode leaves the memory as it was"
    assert ctx.memory.seq_pos_max(1) == -1
    with pytest.raises(ContextFullError):
        ctx.decode_tokens(prefix_tokens * 2, seq_id=1)


def test_bad_model_and_context_params(model: Model, tmp_path: Path) -> None:
    with pytest.raises(ModelError):
        Model(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelError):
        Model(bad)
    for kw in ({"n_seq_max": 257}, {"n_ctx": 0}, {"n_threads": 0}, {"flash_attn": "maybe"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            model.context(**kw)


def test_objects_are_freed_when_an_exception_passes(model: Model) -> None:
    with pytest.raises(RuntimeError), model.context(n_ctx=256, n_threads=2) as ctx:
        raise RuntimeError("boom")
    assert ctx.closed
    with pytest.raises(LlamaError, match="closed"):
        ctx.memory.seq_pos_max(0)
    s = Sampler()
    with pytest.raises(RuntimeError), s:
        raise RuntimeError("boom")
    with pytest.raises(LlamaError, match="closed"):
        s.reset()


def test_closing_the_model_closes_its_contexts(model_path: Path) -> None:
    m = Model(model_path, n_gpu_layers=0)
    ctx = m.context(n_ctx=256, n_threads=2)
    m.close()
    assert ctx.closed and m.closed
    with pytest.raises(LlamaError):
        ctx.decode_tokens([1])


# -- state -----------------------------------------------------------------------------
def test_seq_state_bytes_roundtrip(make_context: MakeCtx, prefix_tokens: list[int]) -> None:
    ctx = make_context(n_ctx=512, n_seq_max=2)
    ctx.decode_tokens(prefix_tokens, seq_id=0, logits_last=False)
    data = ctx.seq_state_bytes(0)
    ctx2 = make_context(n_ctx=512, n_seq_max=2)
    assert ctx2.set_seq_state_bytes(data, 1) == len(data)
    assert (ctx2.memory.seq_pos_min(1), ctx2.memory.seq_pos_max(1)) == (0, len(prefix_tokens) - 1)
    nxt = prefix_tokens[0]
    ia = ctx.decode_tokens([nxt], seq_id=0)
    ib = ctx2.decode_tokens([nxt], seq_id=1)
    assert ia is not None and ib is not None and ctx.logits(ia) == ctx2.logits(ib)
    with pytest.raises(StateError):
        ctx2.set_seq_state_bytes(b"not a state" * 4, 0)
    nonu = make_context(n_ctx=512, n_seq_max=2, kv_unified=False)
    with pytest.raises(StateError):
        nonu.set_seq_state_bytes(data, 0)  # stream count differs


def test_seq_state_file_roundtrip(make_context: MakeCtx, prefix_tokens: list[int], tmp_path: Path) -> None:
    ctx = make_context(n_ctx=512, n_seq_max=2)
    ctx.decode_tokens(prefix_tokens, seq_id=0, logits_last=False)
    path = tmp_path / "seq.bin"
    assert ctx.save_seq_file(path, 0, prefix_tokens) > 0
    ctx2 = make_context(n_ctx=512, n_seq_max=2)
    assert ctx2.load_seq_file(path, 1) == prefix_tokens
    assert ctx2.memory.seq_pos_max(1) == len(prefix_tokens) - 1
    with pytest.raises(StateError):
        ctx2.load_seq_file(tmp_path / "missing.bin", 0)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\0" * 64)
    with pytest.raises(StateError):
        ctx2.load_seq_file(junk, 0)

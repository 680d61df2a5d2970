"""SharedPrefixEngine on the real default model: sharing is exact and pays for the prefix once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from memory_data import PREFIX_TEXT, SUFFIXES, THREADS

from polykv_py.engine import EngineRunResult, GenerationParams, SharedPrefixEngine
from polykv_py.errors import ContextFullError, SequenceError, TokenError
from polykv_py.llama import Batch, ContextParams, Model, SamplingParams

pytestmark = pytest.mark.integration

MAX_TOKENS = 8
GREEDY = GenerationParams(max_tokens=MAX_TOKENS)
# Exact equality needs every decode to take the same CPU flash-attention kernel: ubatches
# below 64 query rows (GGML_FA_TILE_Q; larger ones use the tiled kernel) and, for
# one-row steps, fewer than 512 KV cells (else the split-KV kernel). See docs/memory-api.md.
BASE = ContextParams(n_threads=THREADS, n_ubatch=32, flash_attn="on")


@pytest.fixture(scope="module")
def engine(model: Model) -> Iterator[SharedPrefixEngine]:
    params = SharedPrefixEngine.context_params(4, 200, 20, MAX_TOKENS, share=False, base=BASE)
    with SharedPrefixEngine(model, params) as eng:
        yield eng


@pytest.fixture(scope="module")
def alone(engine: SharedPrefixEngine, prefix_tokens: list[int], suffix_tokens: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of every agent run alone from scratch (prompt decoded in one pass)."""
    return [engine.run_alone(prefix_tokens + s, GREEDY).tokens for s in suffix_tokens]


def test_first_token_logits_bitwise_equal(
    model: Model, prefix_tokens: list[int], suffix_tokens: list[list[int]]
) -> None:
    """Shared prefix + batched suffixes give the very logits of the prompt decoded alone in one pass."""
    p = len(prefix_tokens)
    with model.context(BASE, n_ctx=512, n_seq_max=3) as ctx:
        ctx.decode_tokens(prefix_tokens, seq_id=0, logits_last=False)
        with Batch(64) as b:
            idx = []
            for i, suf in enumerate(suffix_tokens[:2]):
                ctx.memory.seq_cp(0, i + 1)
                idx.append(b.add_sequence(suf, p, i + 1, logits_last=True)[-1])
            ctx.decode(b)
            shared = [ctx.logits(i) for i in idx]
    for i, suf in enumerate(suffix_tokens[:2]):
        with model.context(BASE, n_ctx=512) as ctx:
            j = ctx.decode_tokens(prefix_tokens + suf, seq_id=0)
            assert j is not None and ctx.logits(j) == shared[i]


def _expected_processed(res: EngineRunResult, n_prefix: int) -> int:
    return n_prefix + sum(len(a.suffix_tokens) + len(a.tokens) for a in res.agents)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_shared_equals_alone_greedy(
    engine: SharedPrefixEngine,
    prefix_tokens: list[int],
    suffix_tokens: list[list[int]],
    alone: list[list[int]],
    n: int,
) -> None:
    engine.reset()
    res = engine.run(prefix_tokens, suffix_tokens[:n], GREEDY, measure_kv=True)
    assert res.mode == "shared" and not res.prefix_reused
    for a in res.agents:
        assert a.prompt_tokens == prefix_tokens + suffix_tokens[a.index]
        assert a.tokens == alone[a.index], f"agent {a.index}: shared {a.text!r} differs from alone"
        assert a.stop_reason in ("length", "eos")
        assert a.tokens_processed == len(a.suffix_tokens) + len(a.tokens)
    p = len(prefix_tokens)
    assert res.tokens_processed == _expected_processed(res, p)
    kv = res.kv_cells
    assert kv is not None
    assert kv["after_prefix"] == p and kv["after_share"] == p
    assert kv["after_suffixes"] == p + sum(len(s) for s in suffix_tokens[:n])
    assert kv["final"] == res.tokens_processed, "every decoded token holds exactly one cell"


def test_unshared_baseline_same_tokens_more_work(
    engine: SharedPrefixEngine, prefix_tokens: list[int], suffix_tokens: list[list[int]], alone: list[list[int]]
) -> None:
    res = engine.run(prefix_tokens, suffix_tokens, GREEDY, share=False, measure_kv=True)
    assert res.mode == "unshared"
    assert [a.tokens for a in res.agents] == alone
    p = len(prefix_tokens)
    assert res.tokens_processed == 4 * p + sum(
        len(s) + len(a.tokens) for s, a in zip(suffix_tokens, res.agents, strict=True)
    )
    assert res.kv_cells is not None and res.kv_cells["final"] == res.tokens_processed


def test_prefix_is_reused_across_runs(
    engine: SharedPrefixEngine, prefix_tokens: list[int], suffix_tokens: list[list[int]], alone: list[list[int]]
) -> None:
    engine.reset()
    first = engine.run(prefix_tokens, suffix_tokens[:2], GREEDY)
    second = engine.run(prefix_tokens, suffix_tokens[2:], GREEDY)
    assert not first.prefix_reused and second.prefix_reused
    assert second.tokens_processed == _expected_processed(second, 0)
    assert [a.tokens for a in second.agents] == alone[2:]
    engine.ctx.memory.seq_rm(0, 100, -1)  # edit the prefix behind the engine's back
    third = engine.run(prefix_tokens, suffix_tokens[:1], GREEDY)
    assert not third.prefix_reused and third.agents[0].tokens == alone[0]


def test_a_shifted_prefix_is_recomputed_not_shared(
    engine: SharedPrefixEngine, prefix_tokens: list[int], suffix_tokens: list[list[int]], alone: list[list[int]]
) -> None:
    """Behind the engine's back, cut 10 cells out of the prefix, shift the rest into place and decode 10 more at the
    end: the positions are the prefix's again, the cells are not its tokens' (issue 34). The engine recomputes."""
    engine.reset()
    engine.run(prefix_tokens, suffix_tokens[:1], GREEDY)
    mem, n = engine.ctx.memory, len(prefix_tokens)
    mem.seq_rm(0, 40, 50)
    mem.seq_add(0, 50, -1, -10)
    engine.ctx.decode_tokens(prefix_tokens[-10:], seq_id=0, pos0=n - 10, logits_last=False)
    assert mem.seq_pos_range(0) == (0, n - 1) and mem.exact_len(0) == 40
    again = engine.run(prefix_tokens, suffix_tokens[:2], GREEDY)
    assert not again.prefix_reused
    assert [a.tokens for a in again.agents] == alone[:2]


def test_text_inputs_joint_tokenization(engine: SharedPrefixEngine, model: Model) -> None:
    res = engine.run(PREFIX_TEXT, SUFFIXES[:2], GenerationParams(max_tokens=4))
    for a, suffix in zip(res.agents, SUFFIXES[:2], strict=True):
        assert a.prompt_tokens == model.tokenize(PREFIX_TEXT + suffix), "agent prompt = its full text, tokenized"
    assert len(res.prefix_tokens) <= len(model.tokenize(PREFIX_TEXT))


def test_stop_strings_and_eos(
    engine: SharedPrefixEngine, prefix_tokens: list[int], suffix_tokens: list[list[int]]
) -> None:
    free = engine.run(prefix_tokens, suffix_tokens[:1], GREEDY).agents[0]
    assert len(free.text) > 3
    stop = free.text[2:4]
    res = engine.run(prefix_tokens, suffix_tokens[:1], GenerationParams(max_tokens=MAX_TOKENS, stop=(stop,)))
    a = res.agents[0]
    assert a.stop_reason == "stop" and stop not in a.text and free.text.startswith(a.text)
    assert a.tokens == free.tokens[: len(a.tokens)]


def test_seeded_sampling_shared_equals_alone(
    engine: SharedPrefixEngine, prefix_tokens: list[int], suffix_tokens: list[list[int]]
) -> None:
    gp = GenerationParams(max_tokens=8, sampling=SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234))
    engine.reset()
    res = engine.run(prefix_tokens, suffix_tokens[:2], gp)
    again = engine.run(prefix_tokens, suffix_tokens[:2], gp)
    assert [a.tokens for a in res.agents] == [a.tokens for a in again.agents]
    solo = engine.run_alone(prefix_tokens + suffix_tokens[1], gp, agent_index=1)
    assert solo.tokens == res.agents[1].tokens


def test_non_unified_engine_copies_whole_sequences(
    model: Model, prefix_tokens: list[int], suffix_tokens: list[list[int]], alone: list[list[int]]
) -> None:
    params = SharedPrefixEngine.context_params(2, 200, 20, MAX_TOKENS, kv_unified=False, base=BASE)
    with SharedPrefixEngine(model, params) as eng:
        assert eng.mode == "copied"
        res = eng.run(prefix_tokens, suffix_tokens[:2], GREEDY, measure_kv=True)
        assert res.mode == "copied"
        assert [a.tokens for a in res.agents] == alone[:2]
        p = len(prefix_tokens)
        assert res.kv_cells is not None
        assert res.kv_cells["final"] == 3 * p + sum(
            len(s) + len(a.tokens) for s, a in zip(suffix_tokens[:2], res.agents, strict=True)
        )


def test_engine_bad_inputs(
    engine: SharedPrefixEngine, prefix_tokens: list[int], suffix_tokens: list[list[int]]
) -> None:
    with pytest.raises(SequenceError, match="n_seq_max"):
        engine.run(prefix_tokens, suffix_tokens * 2, GREEDY)  # 8 agents, 5 sequences
    with pytest.raises(TokenError, match="agent 1"):
        engine.run(prefix_tokens, [suffix_tokens[0], []], GREEDY)
    with pytest.raises(TokenError):
        engine.run([], suffix_tokens[:1], GREEDY)
    with pytest.raises(TokenError):
        engine.run(prefix_tokens, [[10**9]], GREEDY)
    with pytest.raises(ValueError, match="non-empty list"):
        engine.run(prefix_tokens, "not a list", GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        GenerationParams(max_tokens=0)
    with pytest.raises(ValueError, match="stop"):
        GenerationParams(stop="x")  # type: ignore[arg-type]
    with pytest.raises(ContextFullError):
        engine.run(prefix_tokens * 10, suffix_tokens[:1], GREEDY)
    with pytest.raises(ContextFullError):
        engine.run(prefix_tokens, suffix_tokens, GenerationParams(max_tokens=engine.ctx.n_ctx))
    # the engine still works after refusing
    assert engine.run(prefix_tokens, suffix_tokens[:1], GenerationParams(max_tokens=2)).agents[0].tokens

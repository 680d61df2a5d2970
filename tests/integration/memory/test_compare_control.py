"""The comparator has teeth: a share over the wrong KV, forced in-process, comes out ``different``.

A pool sequence holds a base; a sharer gets the pool's cells [0, P) with ``seq_cp`` and decodes
its question after them, then generates greedily. Against the same question answered over its
own, correctly computed base (same split: base first, then the question; same cell layout, so a
correct share is exact), the comparator must say:

- ``identical`` for the correct share (positive control);
- ``different`` when the pool's base differs from the sharer's by one token (in the middle);
- ``different`` when the pool's tokens are shifted by one position (one extra token after BOS),
  i.e. every shared cell holds its neighbour's token: the off-by-one share of design trap 1;
- ``different`` even with the layout-tolerant margins when the pool holds another context.

These compare with :data:`~polykv_py.harness.compare.EXACT` margins: same layout, so a correct
share is bit-exact. Across layouts a one-token-off base moves log-probabilities as much as layout
rounding does on this model (see :mod:`polykv_py.harness.compare`), so only a gross error is
visible there.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from memory_data import PREFIX_TEXT, SUFFIXES

from polykv_py.harness.compare import EXACT, LAYOUT, Step, compare_steps, step_from_logits
from polykv_py.llama import Context, Model

pytestmark = pytest.mark.integration

N_GEN = 16
POOL, SHARER, REFERENCE = 0, 1, 2


def _generate(ctx: Context, seq: int, idx: int | None, n: int) -> list[Step]:
    """Greedy tokens from the logits at batch index ``idx`` on, with their log-probabilities."""
    steps: list[Step] = []
    for _ in range(n):
        assert idx is not None
        logits = ctx.logits(idx)
        token = max(range(len(logits)), key=logits.__getitem__)
        steps.append(step_from_logits(token, logits))
        idx = ctx.decode_tokens([token], seq_id=seq)
    return steps


def _answer(ctx: Context, pool_tokens: list[int], question: list[int], n_shared: int) -> list[Step]:
    """Prime the pool with ``pool_tokens``, share its first ``n_shared`` cells, answer ``question``."""
    mem = ctx.memory
    mem.clear()  # same cell layout as the reference: base in cells [0, P), question after it
    ctx.decode_tokens(pool_tokens, seq_id=POOL, logits_last=False)
    mem.seq_cp(POOL, SHARER, 0, n_shared)
    idx = ctx.decode_tokens(question, seq_id=SHARER, pos0=n_shared)
    return _generate(ctx, SHARER, idx, N_GEN)


@pytest.fixture(scope="module")
def setup(model: Model) -> tuple[list[int], list[int]]:
    """(base tokens, question tokens)."""
    return model.tokenize(PREFIX_TEXT), model.tokenize(SUFFIXES[0], add_special=False)


@pytest.fixture
def ctx(make_context: Callable[..., Context]) -> Context:
    return make_context(n_ctx=1024, n_seq_max=3, kv_unified=True, flash_attn="on", n_batch=512, n_ubatch=512)


def _reference(ctx: Context, base: list[int], question: list[int]) -> list[Step]:
    """The question answered over its own base, computed in the same split as a share (base, then question)."""
    ctx.memory.clear()
    ctx.decode_tokens(base, seq_id=REFERENCE, logits_last=False)
    idx = ctx.decode_tokens(question, seq_id=REFERENCE)
    return _generate(ctx, REFERENCE, idx, N_GEN)


def test_a_correct_share_passes(ctx: Context, setup: tuple[list[int], list[int]]) -> None:
    base, question = setup
    ref = _reference(ctx, base, question)
    got = _answer(ctx, base, question, len(base))
    cmp = compare_steps(ref, got, margins=EXACT)
    assert cmp.verdict == "identical", cmp.detail
    assert cmp.max_drift == 0.0


def test_a_base_one_token_off_is_different(ctx: Context, setup: tuple[list[int], list[int]]) -> None:
    base, question = setup
    ref = _reference(ctx, base, question)
    wrong = list(base)
    mid = len(base) // 2
    wrong[mid] = base[mid + 1] if base[mid + 1] != base[mid] else base[mid - 1]
    cmp = compare_steps(ref, _answer(ctx, wrong, question, len(base)), margins=EXACT)
    assert cmp.verdict == "different", cmp


def test_a_share_shifted_by_one_position_is_different(ctx: Context, setup: tuple[list[int], list[int]]) -> None:
    base, question = setup
    ref = _reference(ctx, base, question)
    shifted = [base[0], base[1], *base[1:-1]]  # BOS, then the base one cell late (its last token dropped)
    cmp = compare_steps(ref, _answer(ctx, shifted, question, len(base)), margins=EXACT)
    assert cmp.verdict == "different", cmp


def test_an_answer_over_another_context_is_different_even_across_layouts(
    ctx: Context, model: Model, setup: tuple[list[int], list[int]]
) -> None:
    base, question = setup
    ref = _reference(ctx, base, question)
    other = model.tokenize(PREFIX_TEXT.replace("Lyon", "Oslo").replace("18:00", "16:30").replace("Porto", "Gent"))
    cmp = compare_steps(ref, _answer(ctx, other, question, len(other)), margins=LAYOUT)
    assert cmp.verdict == "different", cmp

"""The comparator's verdicts on hand-made runs, and its margins against the measured noise."""

from __future__ import annotations

import math

import pytest

from polykv_py.harness.compare import (
    EXACT,
    LAYOUT,
    MEASURED_LAYOUT_DRIFT,
    Margins,
    Step,
    compare_chat,
    compare_greedy,
    compare_steps,
    step_from_logits,
    steps_from_completion,
)


def run(*tokens: tuple[int, float], alt: dict[int, float] | None = None) -> list[Step]:
    return [Step(t, lp, {t: lp, **(alt or {})}) for t, lp in tokens]


def test_margins_come_from_the_measured_noise() -> None:
    assert MEASURED_LAYOUT_DRIFT < LAYOUT.drift <= 2 * MEASURED_LAYOUT_DRIFT
    assert LAYOUT.tie == 2 * LAYOUT.drift
    assert Margins(0.0, 0.0) == EXACT


def test_exact_margins_refuse_any_drift() -> None:
    a = run((1, -0.1), (2, -0.5))
    assert compare_steps(a, list(a), margins=EXACT).verdict == "identical"
    assert compare_steps(a, run((1, -0.1), (2, -0.5001)), margins=EXACT).verdict == "different"


def test_identical_runs() -> None:
    a = run((1, -0.1), (2, -0.5), (3, -0.2))
    cmp = compare_steps(a, list(a))
    assert (cmp.verdict, cmp.n_tokens, cmp.max_drift, cmp.diverged_at) == ("identical", 3, 0.0, None)


def test_drift_within_the_noise_is_identical() -> None:
    cmp = compare_steps(run((1, -0.1), (2, -0.5)), run((1, -0.11), (2, -0.52)))
    assert cmp.verdict == "identical" and math.isclose(cmp.max_drift, 0.02)


def test_drift_over_the_margin_is_different_and_every_token_is_counted() -> None:
    a = run((1, -0.1), (2, -0.5), (3, -0.2), (4, -0.3))
    b = run((1, -0.7), (2, -0.5), (3, -0.9), (4, -0.3))  # tokens 0 and 2 drift by 0.6 and 0.7
    cmp = compare_steps(a, b)
    assert cmp.verdict == "different"
    assert cmp.n_over_margin == 2 and math.isclose(cmp.max_drift, 0.7)
    assert "first at 0" in cmp.detail


def test_the_old_margin_would_have_let_a_wrong_share_pass() -> None:
    # 0.6 nat on every token (another context); the old comparator allowed 1.0
    a = run((1, -0.1), (2, -0.5))
    b = run((1, -0.7), (2, -1.1))
    assert compare_steps(a, b, margins=Margins(1.0, 0.5)).verdict == "identical"
    assert compare_steps(a, b).verdict == "different"


def test_a_flip_at_a_near_tie_is_tolerated() -> None:
    a = [Step(1, -0.1, {1: -0.1}), Step(5, -0.70, {5: -0.70, 6: -0.74})]
    b = [Step(1, -0.1, {1: -0.1}), Step(6, -0.71, {6: -0.71, 5: -0.73})]
    cmp = compare_steps(a, b)
    assert (cmp.verdict, cmp.diverged_at) == ("near_tie", 1)
    assert cmp.tie_gap is not None and cmp.tie_gap <= LAYOUT.tie


def test_a_confident_flip_is_different() -> None:
    a = [Step(5, -0.2, {5: -0.2, 6: -2.0})]
    b = [Step(6, -0.3, {6: -0.3, 5: -1.5})]
    assert compare_steps(a, b, margins=EXACT).verdict == "different"
    assert compare_steps(a, b).verdict == "different"


def test_a_flip_to_a_token_the_other_run_did_not_rank_is_different() -> None:
    a = [Step(5, -0.2, {5: -0.2, 7: -0.21})]
    b = [Step(6, -0.2, {6: -0.2, 5: -0.21})]
    cmp = compare_steps(a, b)
    assert cmp.verdict == "different" and cmp.tie_gap == math.inf


def test_a_tie_after_drift_over_the_margin_is_different() -> None:
    a = [Step(1, -0.1, {1: -0.1}), Step(5, -0.70, {5: -0.70, 6: -0.71})]
    b = [Step(1, -0.7, {1: -0.7}), Step(6, -0.70, {6: -0.70, 5: -0.71})]
    cmp = compare_steps(a, b)
    assert cmp.verdict == "different" and "drifted" in cmp.detail


def test_lengths_and_text() -> None:
    a = run((1, -0.1), (2, -0.5))
    assert compare_steps(a, a[:1]).verdict == "different"
    assert compare_steps(a, a, text_a="x", text_b="y").verdict == "different"


def test_completion_adapter_reads_llama_server_probabilities() -> None:
    resp = {
        "content": " Paris",
        "completion_probabilities": [
            {
                "id": 9,
                "token": " Paris",
                "logprob": -0.1,
                "top_logprobs": [
                    {"id": 9, "token": " Paris", "logprob": -0.1},
                    {"id": 4, "token": " Lyon", "logprob": -3},
                ],
            }
        ],
    }
    (step,) = steps_from_completion(resp)
    assert (step.token, step.piece, step.logprob_of(4)) == (9, " Paris", -3.0)
    assert compare_greedy(resp, resp).verdict == "identical"
    with pytest.raises(ValueError, match="n_probs"):
        steps_from_completion({"content": "x"})


def test_chat_adapter_reads_openai_logprobs() -> None:
    def choice(token_id: int, text: str, logprob: float) -> dict[str, object]:
        top = [{"id": token_id, "token": text, "logprob": logprob}, {"id": 4, "token": " Lyon", "logprob": -3.0}]
        content = [{"id": token_id, "token": text, "logprob": logprob, "top_logprobs": top}]
        return {"message": {"role": "assistant", "content": text}, "logprobs": {"content": content}}

    paris = choice(9, " Paris", -0.1)
    assert compare_chat(paris, choice(9, " Paris", -0.1001)).verdict == "identical"
    assert compare_chat(paris, choice(7, " Rome", -0.1)).verdict == "different"  # a confident flip


def test_logits_adapter_is_a_log_softmax() -> None:
    step = step_from_logits(2, [0.0, 1.0, 3.0], top_k=2)
    total = math.log(math.exp(0.0) + math.exp(1.0) + math.exp(3.0))
    assert math.isclose(step.logprob, 3.0 - total)
    assert set(step.top) == {2, 1}

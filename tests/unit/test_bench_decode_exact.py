"""The decode benchmark's exactness pass: off against on per agent, flips with their log-prob gaps."""

from __future__ import annotations

from typing import Any

from bench import decode_exact


def _step(tok: int, lp: float, alts: dict[int, float]) -> dict[str, Any]:
    top = [{"id": tok, "logprob": lp}] + [{"id": t, "logprob": v} for t, v in alts.items()]
    return {"id": tok, "logprob": lp, "token": f"<{tok}>", "top_logprobs": top}


def _answer(steps: list[dict[str, Any]], slot: int) -> dict[str, Any]:
    layout = {"id_slot": slot, "tokens_cached": 100, "shared_prefix": {"status": "hit"}}
    timings = {"prompt_n": 12, "cache_n": 88}
    text = "".join(s["token"] for s in steps)
    return {"content": text, "completion_probabilities": steps, **layout, "timings": timings}


def _pair() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    same = [_step(1, -0.1, {2: -3.0}), _step(3, -0.2, {4: -2.5})]
    off = [
        _answer(same, 1),
        # a flip at token 1: off picks 5 over 6 by 0.05, on picks 6 over 5 by 0.03
        _answer([_step(1, -0.1, {2: -3.0}), _step(5, -0.70, {6: -0.75})], 2),
        # a confident flip at token 0 (gap 4.0 in the off run): different
        _answer([_step(7, -0.01, {8: -4.01})], 3),
    ]
    on = [
        _answer([_step(1, -0.12, {2: -3.0}), _step(3, -0.19, {4: -2.5})], 1),
        _answer([_step(1, -0.1, {2: -3.0}), _step(6, -0.71, {5: -0.74})], 2),
        _answer([_step(8, -0.5, {7: -0.9})], 3),
    ]
    return off, on


def test_flips_are_counted_with_their_token_and_gap() -> None:
    off, on = _pair()
    s = decode_exact.summarize(off, on)
    assert (s["n"], s["identical"], s["near_tie"], s["different"]) == (3, 1, 1, 1)
    assert s["max_drift"] == 0.02 and s["same_layout"] is True
    tie, diff = s["flips"]
    assert (tie["agent"], tie["token"], tie["verdict"], tie["gap"]) == (1, 1, "near_tie", 0.05)
    assert (diff["agent"], diff["token"], diff["verdict"], diff["gap"]) == (2, 0, "different", 4.0)


def test_a_shorter_g_compares_the_first_tokens_of_the_longer_answers() -> None:
    # the near tie at token 1 lies beyond G = 1; the confident flip at token 0 does not
    off, on = _pair()
    s = decode_exact.summarize(off, on, 1)
    assert (s["identical"], s["near_tie"], s["different"]) == (2, 0, 1)
    assert [f["agent"] for f in s["flips"]] == [2]


def test_a_layout_that_differs_is_reported() -> None:
    off, on = _pair()
    on[0]["id_slot"] = 9
    assert decode_exact.summarize(off, on)["same_layout"] is False


def test_the_report_lists_each_flip() -> None:
    off, on = _pair()
    row = {"p": 4096, "n_agents": 3, "gen": 2, **decode_exact.summarize(off, on)}
    md = "\n".join(decode_exact.markdown([row]))
    assert "| 4,096 |" in md and "t0: 4.0, t1: 0.05" in md and "| yes " in md
    assert decode_exact.markdown([]) == []

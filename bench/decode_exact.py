"""Exactness of the shared-decode path on long answers: one fixed batch, off against on, with log-prob gaps.

The timed cells of :mod:`bench.decode` send their agents one by one, so each server batches them as they
arrive and answers differ even where the path is not used. Here each server gets the N agents as one
multi-prompt ``/completion`` (as ``tests/integration/test_shared_decode.py`` does): both put every agent in
the same slot and cells and decode the same batches (two runs of one recipe answer byte for byte alike), so
all that differs is the attention's rounding. Each agent's greedy answer on is compared with its answer off
token by token (:func:`polykv_py.harness.compare.compare_steps`, LAYOUT margins): ``identical``, or a flip at
a near tie (both runs' gap between the two picks <= 1.0 log-prob) or ``different``. The report gives every
flip's token and gap and the largest drift of a token both runs picked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from polykv_py.client import Share
from polykv_py.harness.compare import LAYOUT, compare_steps, steps_from_probs

from .multiturn import question_block

#: n_probs 20: at a flip the comparator must find the other run's pick among the candidates (with 5 it once
#: did not: tests/integration/test_shared_decode.py)
PARAMS: dict[str, Any] = {"temperature": 0.0, "n_probs": 20, "ignore_eos": True}
#: what must match per agent for the comparison to be like for like
LAYOUT_FIELDS = ("id_slot", "tokens_cached", "shared_prefix")


def one_batch(server: Any, base: str, n: int, gen: int) -> list[dict[str, Any]]:
    """The pool primed into slot 0, then N agents over it in one multi-prompt request (greedy, with log-probs)."""
    c = server.client
    c.prime(base, 0)
    res = c.completion([base + question_block(i, 0)[0] for i in range(n)], share=Share(0), n_predict=gen, **PARAMS)
    if not isinstance(res, list) or len(res) != n:
        raise RuntimeError(f"expected {n} answers from one multi-prompt request, got {type(res).__name__}")
    return res


def layout_of(answer: dict[str, Any]) -> list[Any]:
    """Slot, cached tokens, share and the prompt/cache token counts of one answer."""
    t = answer.get("timings", {})
    return [answer.get(k) for k in LAYOUT_FIELDS] + [t.get("prompt_n"), t.get("cache_n")]


def summarize(off: Sequence[dict[str, Any]], on: Sequence[dict[str, Any]], gen: int | None = None) -> dict[str, Any]:
    """Verdict counts, every flip (agent, token, gap) and the largest drift of an agreed token, over each answer's
    first ``gen`` tokens (None: all; in one fixed batch the first G tokens of a longer answer are the answer at G,
    so one batch at the largest G serves every smaller one)."""
    cmps = [
        compare_steps(
            steps_from_probs(a["completion_probabilities"][:gen]),
            steps_from_probs(b["completion_probabilities"][:gen]),
            text_a=a.get("content") if gen is None else None,
            text_b=b.get("content") if gen is None else None,
            margins=LAYOUT,
        )
        for a, b in zip(off, on, strict=True)
    ]
    verdicts = Counter(c.verdict for c in cmps)
    flips = [
        {"agent": i, "token": c.diverged_at, "gap": None if c.tie_gap is None else round(c.tie_gap, 4),
         "verdict": c.verdict, "detail": c.detail}
        for i, c in enumerate(cmps)
        if c.verdict != "identical"
    ]  # fmt: skip
    return {
        "n": len(cmps),
        "identical": verdicts["identical"],
        "near_tie": verdicts["near_tie"],
        "different": verdicts["different"],
        "max_drift": round(max((c.max_drift for c in cmps), default=0.0), 4),
        "flips": flips,
        "same_layout": all(layout_of(a) == layout_of(b) for a, b in zip(off, on, strict=True)),
        "margins": {"drift": LAYOUT.drift, "tie": LAYOUT.tie},
    }


def markdown(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The exactness section of decode.md: one row per (P, N, G)."""
    from polykv_py.harness.report import table

    if not rows:
        return []

    def gaps(r: dict[str, Any]) -> str:
        fl = sorted(r["flips"], key=lambda f: f["token"] if f["token"] is not None else 1 << 30)
        return ", ".join(f"t{f['token']}: {f['gap']}" if f["gap"] is not None else f["detail"] for f in fl) or "none"

    def row(r: dict[str, Any]) -> list[Any]:
        same = "yes" if r["same_layout"] else "NO"
        return [f"{r['p']:,}", r["n_agents"], r["gen"], r["identical"], r["near_tie"], r["different"], r["max_drift"],
                same, gaps(r)]  # fmt: skip

    return [
        "## Exactness: one fixed batch per server, off vs on",
        "",
        "Each server got the N agents as one multi-prompt request (same slots, cells and batches; two runs of one "
        "recipe answer byte for byte alike), greedy with n_probs 20. Per agent, the answer on against the answer "
        f"off (LAYOUT margins: a flip is a near tie when both runs' gap between the two picks is <= "
        f"{LAYOUT.tie}, an agreed token may drift <= {LAYOUT.drift}). Flips: token index: log-prob gap.",
        "",
        table(
            ["P", "N", "G", "identical", "near tie", "different", "max drift", "same layout", "flips (token: gap)"],
            [row(r) for r in rows],
            markdown=True,
        ),
        "",
    ]

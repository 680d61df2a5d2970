"""Compare two greedy generations token by token, tolerating only layout rounding.

On the CPU backend the attention kernels sum over KV cells in buffer order, so the
same request can round differently when its cells sit elsewhere (another request's
cells in between, a pool re-primed meanwhile). Greedy text then stays the same
unless two candidates are nearly tied, where a rounding difference can flip the pick.

:func:`compare_greedy` takes two responses made with ``n_probs >= 2`` and tells
whether they are identical, or diverge only at a near tie after a prefix whose
log-probabilities agree within ``max_drift``.  Wrong KV (another context, stale
cells) shows up as a confident disagreement and is reported as ``different``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Verdict = Literal["identical", "near_tie", "different"]

#: Log-probability gap between the two picks below which a flip counts as a tie.
TIE_MARGIN = 0.5
#: Largest log-probability difference of the same token tolerated before the divergence.
MAX_DRIFT = 1.0


@dataclass(frozen=True)
class Comparison:
    """Outcome of :func:`compare_greedy`."""

    verdict: Verdict
    n_tokens: int
    #: index of the first differing token, or None
    diverged_at: int | None
    #: largest |logprob_a - logprob_b| over the tokens both runs picked alike
    max_drift: float
    #: at the divergence: the smaller of the two runs' gaps between the two picks
    tie_gap: float | None
    detail: str

    @property
    def ok(self) -> bool:
        return self.verdict != "different"


def _probs(resp: dict[str, Any]) -> list[dict[str, Any]]:
    probs = resp.get("completion_probabilities")
    if not isinstance(probs, list):
        raise ValueError("response has no completion_probabilities: request it with n_probs >= 2")
    return probs


def _logprob_of(entry: dict[str, Any], token_id: int) -> float | None:
    if entry.get("id") == token_id:
        return float(entry["logprob"])
    for alt in entry.get("top_logprobs") or ():
        if alt.get("id") == token_id:
            return float(alt["logprob"])
    return None


def compare_greedy(
    a: dict[str, Any], b: dict[str, Any], *, tie_margin: float = TIE_MARGIN, max_drift: float = MAX_DRIFT
) -> Comparison:
    """Compare two greedy completions (``/completion`` responses with ``n_probs >= 2``)."""
    pa, pb = _probs(a), _probs(b)
    n = min(len(pa), len(pb))
    drift = 0.0
    for i in range(n):
        ea, eb = pa[i], pb[i]
        if ea["id"] == eb["id"]:
            drift = max(drift, abs(float(ea["logprob"]) - float(eb["logprob"])))
            if drift > max_drift:
                return Comparison("different", n, i, drift, None,
                                  f"token {i} {ea['token']!r}: log-probs {ea['logprob']:.3f} vs {eb['logprob']:.3f}")
            continue
        # first divergence: each run must see the other's pick as a close runner-up
        gaps = []
        for e in (ea, eb):
            la, lb = _logprob_of(e, ea["id"]), _logprob_of(e, eb["id"])
            gaps.append(float("inf") if la is None or lb is None else abs(la - lb))
        gap = max(gaps)
        verdict: Verdict = "near_tie" if gap <= tie_margin and drift <= max_drift else "different"
        return Comparison(verdict, n, i, drift, gap,
                          f"token {i}: {ea['token']!r} vs {eb['token']!r}, gap {gap:.3f} (margin {tie_margin})")
    if len(pa) != len(pb):
        return Comparison("different", n, n, drift, None, f"lengths differ: {len(pa)} vs {len(pb)} tokens")
    if a.get("content") != b.get("content"):
        return Comparison("different", n, None, drift, None, "same tokens but different text")
    return Comparison("identical", n, None, drift, None, f"{n} tokens identical, max drift {drift:.3f}")

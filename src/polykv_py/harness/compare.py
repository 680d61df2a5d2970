"""Compare two greedy generations token by token, tolerating only measured layout rounding.

On the CPU backend the attention kernels sum over KV cells in buffer order, so the same
request can round differently when its cells sit elsewhere (another request's cells in
between, a pool re-primed meanwhile). Greedy text then stays the same unless two
candidates are nearly tied, where a rounding difference can flip the pick.

Two sets of margins, from measurements with the default model and flash attention on, first on a
2-core Intel Xeon (AVX-512), re-measured on a 2-core AMD EPYC (AVX-512, 2026-12-06):

- :data:`EXACT`, for two runs with the same cell layout (the gate's checks, the negative
  control): a correct share is bit-exact there (drift 0.0), so any drift is ``different``.
  AMD EPYC: two servers given the same 12 rounds of 16 agents, each round one multi-prompt
  request (same slots, cells and batches), answered 192 of 192 byte-identically, with the
  shared-decode path off and with it on; in-process, two runs are bit-exact either way.
- :data:`LAYOUT`, for runs whose cells sit elsewhere (concurrent agents, a re-primed pool):
  the same greedy request computed in another layout moved the log-probability of the same
  token by up to 0.141 in-process (4 questions x 16 tokens, the base moved by 37 cells),
  0.09-0.20 in the CI-sized load test (7 runs of 24 answers x 8 tokens), 0.18 in the fan-out
  test, 0.264 for a concurrent gate sharer (token 6 of 8, not a near tie), and 0.37 for a
  one-cell shift (docs/shared-prefix.md), all on the Intel Xeon. On the AMD EPYC: 0.20
  in-process (24 answers x 16 tokens, the base moved by 1, 37 or 256 cells: 14 identical / 10
  near tie), 0.29-0.31 between two servers over 192 agents (3 pairs of runs of 12 rounds of 16
  agents, 16 tokens, n_probs 20: agents sent concurrently or each round in one request; 0 of 576
  ``different``); with the shared-decode path (patch 0076) on in one run or both, 0.24-0.41 over
  12 such pairs (0 of 2,304 ``different``), and once 0.54 (1 of 192 agents, on vs on,
  docs/shared-decode.md), which :data:`LAYOUT` counts as ``different``. :data:`LAYOUT` allows
  0.5 per token, and a flip only when both runs' gaps between the two candidates are within
  1.0 (the largest measured: 0.57, next to each constant below). (An earlier note
  measured at most 0.02 on an AMD machine without AVX-512; it holds neither on the Xeon nor on
  the EPYC measured since.)

What each can see: a base that differs by one token in the middle moved the same log-probs
by 0.09-0.23, i.e. as much as layout noise, so only an equal-layout comparison catches it.
On this 135M model even a base with three facts changed moves the answers to questions about
other facts by less than layout noise (0.08-0.33); what :data:`LAYOUT` reliably sees is an
answer that changes (the question's own fact changed: a confident divergence). So the teeth
are the equal-layout checks (the gate's exact phase, the negative control); the layout check
catches wrong answers, not every wrong cell. The negative controls in
``tests/integration/memory/test_compare_control.py`` force such shares through the
in-process engine and require ``different``.

:func:`compare_steps` walks the whole common run (it does not stop at the first token over
the margin, so a report shows how many drifted and by how much); at the first divergence
the two runs' continuations are conditioned on different tokens, so the comparison ends
there with ``near_tie`` or ``different``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Verdict = Literal["identical", "near_tie", "different"]

#: Largest log-probability difference of the same picked token measured between two cell layouts with
#: upstream's attention kernel: 0.37, a one-cell shift on the Intel Xeon (docs/shared-prefix.md); on the AMD
#: EPYC at most 0.31 (3 pairs of 192-agent server runs) and 0.20 in-process. The shared-decode path's own
#: rounding adds to it: 0.41 at most over 12 pairs of 192-agent runs with it on in one or both, once 0.54
#: (see the module docstring).
MEASURED_LAYOUT_DRIFT = 0.37


@dataclass(frozen=True)
class Margins:
    """What a comparison tolerates: drift of the same token's log-probability, and the gap at a flip."""

    drift: float
    tie: float


#: Same cell layout: bit-exact or different. Measured drift 0.0: 192 of 192 server answers byte-identical
#: between two runs (AMD EPYC, path off and path on), and every in-process rerun bit-exact.
EXACT = Margins(drift=0.0, tie=0.0)
#: Different cell layouts: measured rounding noise (see the module docstring). ``drift`` 0.5: above every
#: same-token drift measured on upstream's kernel (0.37 at most) and with the shared-decode path (0.41 over
#: 2,304 agents on the AMD EPYC), below the one outlier (0.54, 1 token of 1 agent in 192, path on in both runs).
#: ``tie`` 1.0 (twice ``drift``): the largest gap between the two picks at a flip measured 0.57 on the AMD EPYC
#: (935 flips among those 2,304 agents, 2 over 0.5; 216 flips among 576 agents with the path off, largest
#: 0.46), 0.30 in-process, 0.32 over 384 agents earlier.
LAYOUT = Margins(drift=0.5, tie=1.0)


@dataclass(frozen=True)
class Step:
    """One generated token: its id, its log-probability, and the runners-up the run saw."""

    token: int
    logprob: float
    top: Mapping[int, float] = field(default_factory=dict)  # token id -> log-probability (includes ``token``)
    piece: str = ""

    def logprob_of(self, token: int) -> float | None:
        """The log-probability this run gave ``token`` (None if it was not among the top candidates)."""
        if token == self.token:
            return self.logprob
        return self.top.get(token)


@dataclass(frozen=True)
class Comparison:
    """Outcome of :func:`compare_steps` / :func:`compare_greedy`."""

    verdict: Verdict
    n_tokens: int  # tokens compared (the shorter run)
    diverged_at: int | None  # index of the first differing token, or None
    max_drift: float  # largest |logprob_a - logprob_b| over the tokens both runs picked alike
    n_over_margin: int  # how many of those exceeded MAX_DRIFT
    tie_gap: float | None  # at the divergence: the larger of the two runs' gaps between the picks
    detail: str

    @property
    def ok(self) -> bool:
        """True unless the verdict is ``different``."""
        return self.verdict != "different"


def compare_steps(
    a: Sequence[Step],
    b: Sequence[Step],
    *,
    text_a: str | None = None,
    text_b: str | None = None,
    margins: Margins = LAYOUT,
) -> Comparison:
    """Compare two greedy runs step by step (see the module docstring for the margins)."""
    max_drift, tie_margin = margins.drift, margins.tie
    n = min(len(a), len(b))
    drift, over, first_over = 0.0, 0, None
    for i in range(n):
        sa, sb = a[i], b[i]
        if sa.token == sb.token:
            d = abs(sa.logprob - sb.logprob)
            drift = max(drift, d)
            if d > max_drift:
                over += 1
                first_over = i if first_over is None else first_over
            continue
        # first divergence: each run must see the other's pick as a close runner-up
        gaps = []
        for s in (sa, sb):
            la, lb = s.logprob_of(sa.token), s.logprob_of(sb.token)
            gaps.append(math.inf if la is None or lb is None else abs(la - lb))
        gap = max(gaps)
        tie = gap <= tie_margin and over == 0
        detail = f"token {i}: {sa.piece or sa.token!r} vs {sb.piece or sb.token!r}, gap {gap:.4f} (margin {tie_margin})"
        if over:
            detail += f"; {over} earlier token(s) drifted over {max_drift} (first at {first_over}, max {drift:.4f})"
        return Comparison("near_tie" if tie else "different", n, i, drift, over, gap, detail)
    if over:
        return Comparison(
            "different",
            n,
            None,
            drift,
            over,
            None,
            f"{over} of {n} tokens drifted over {max_drift} (first at {first_over}, max {drift:.4f})",
        )
    if len(a) != len(b):
        return Comparison("different", n, n, drift, 0, None, f"lengths differ: {len(a)} vs {len(b)} tokens")
    if text_a is not None and text_b is not None and text_a != text_b:
        return Comparison("different", n, None, drift, 0, None, "same tokens but different text")
    return Comparison("identical", n, None, drift, 0, None, f"{n} tokens identical, max drift {drift:.4f}")


# --------------------------------------------------------------------------- adapters
def steps_from_completion(resp: Mapping[str, Any]) -> list[Step]:
    """The steps of a llama-server ``/completion`` answer made with ``n_probs >= 2``."""
    probs = resp.get("completion_probabilities")
    if not isinstance(probs, list):
        raise ValueError("response has no completion_probabilities: request it with n_probs >= 2")
    return steps_from_probs(probs)


def steps_from_probs(probs: Sequence[Mapping[str, Any]]) -> list[Step]:
    """Steps from llama-server's per-token probabilities (``/completion``'s ``completion_probabilities``, or
    an OpenAI route's ``choices[0].logprobs.content``; both carry ``id`` and ``top_logprobs``)."""
    steps = []
    for e in probs:
        top = {int(alt["id"]): float(alt["logprob"]) for alt in e.get("top_logprobs") or ()}
        steps.append(Step(int(e["id"]), float(e["logprob"]), top, str(e.get("token", ""))))
    return steps


def step_from_logits(token: int, logits: Sequence[float], *, top_k: int = 5, piece: str = "") -> Step:
    """A step from a model's raw logits (log-softmax; the ``top_k`` best candidates kept)."""
    m = max(logits)
    log_z = m + math.log(sum(math.exp(x - m) for x in logits))
    best = sorted(range(len(logits)), key=logits.__getitem__, reverse=True)[:top_k]
    return Step(token, logits[token] - log_z, {t: logits[t] - log_z for t in best}, piece)


def compare_greedy(a: Mapping[str, Any], b: Mapping[str, Any], *, margins: Margins = LAYOUT) -> Comparison:
    """Compare two greedy ``/completion`` answers (made with ``n_probs >= 2``)."""
    return compare_steps(
        steps_from_completion(a),
        steps_from_completion(b),
        text_a=a.get("content"),
        text_b=b.get("content"),
        margins=margins,
    )


def compare_chat(a: Mapping[str, Any], b: Mapping[str, Any], *, margins: Margins = LAYOUT) -> Comparison:
    """Compare two greedy OpenAI chat choices (``choices[i]`` as a dict, made with ``logprobs`` and
    ``top_logprobs >= 2``)."""
    return compare_steps(
        steps_from_probs(a["logprobs"]["content"]),
        steps_from_probs(b["logprobs"]["content"]),
        text_a=a["message"]["content"],
        text_b=b["message"]["content"],
        margins=margins,
    )

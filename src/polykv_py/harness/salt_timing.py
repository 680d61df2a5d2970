"""Does a request's time to first token tell whether another tenant computed its prefix? (issue 34)

Paired trials against a ``--share-any`` server, each over a prefix no earlier trial used. Tenant A computes the
prefix (``hit``) or another text of the same length (``miss``); then tenant B sends prefix + question and times its
first token. Across salts the two must be indistinguishable: B's request never takes, waits for or is placed by
another salt's cells. Within one salt (``same_salt_hit``: B computed the prefix itself) a hit is faster by design:
the control that shows the measurement can see a difference.

:func:`auc` is the probability that a hit is faster than a miss (ties half): 0.5 means TTFT says nothing, 1.0
that it always tells.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..client import Client

CASES = ("hit", "miss", "same_salt_hit")


def auc(lower: list[float], higher: list[float]) -> float:
    """P(a value of ``lower`` < a value of ``higher``), ties counting half."""
    pairs = [(a < b) + 0.5 * (a == b) for a in lower for b in higher]
    return sum(pairs) / len(pairs)


def _document(tag: str) -> str:
    return f"Ledger {tag}.\n" + "\n".join(f"Entry {i}: {tag} stores {(i * 37) % 101} crates." for i in range(24))


@dataclass
class SaltTiming:
    """TTFT in seconds per case, and the two AUCs."""

    ttft: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CASES})

    @property
    def auc_across_salts(self) -> float:
        return auc(self.ttft["hit"], self.ttft["miss"])

    @property
    def auc_within_salt(self) -> float:
        return auc(self.ttft["same_salt_hit"], self.ttft["miss"])

    def to_json(self) -> dict[str, Any]:
        return {"auc_across_salts": self.auc_across_salts, "auc_within_salt": self.auc_within_salt, **self.ttft}


def measure_salt_timing(url: str, *, trials: int, salt_a: str, salt_b: str) -> SaltTiming:
    """Run ``trials`` rounds of the three cases against the server at ``url`` (sequentially, nothing else sent)."""
    out = SaltTiming()
    with Client(url, timeout=600) as c:

        def timed(prompt: str, salt: str) -> float:
            t0 = time.perf_counter()
            c.completion(prompt, n_predict=1, temperature=0, cache_salt=salt)
            return time.perf_counter() - t0

        timed(_document("warm-up"), salt_a)
        for k in range(trials):
            question = f"\nQuestion: what does entry {k} store?\nAnswer:"
            for case in CASES:
                prefix = _document(f"trial-{k}-{case}")
                first = _document(f"trial-{k}-other") if case == "miss" else prefix
                first_salt = salt_b if case == "same_salt_hit" else salt_a
                c.completion(first, n_predict=1, temperature=0, cache_salt=first_salt)
                out.ttft[case].append(timed(prefix + question, salt_b))
    return out

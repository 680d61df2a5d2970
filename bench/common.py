"""What the fan-out and restart benchmarks share: their inputs, KV budgets, samplers and summaries.

:mod:`bench.fanout` and :mod:`bench.restart` both import from here; only ``bench.fanout`` imports the other
(``--restart`` hands over to :mod:`bench.restart`).
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from statistics import mean, median
from typing import Self

from polykv_py.data import sample_document
from polykv_py.harness.texts import Detokenize, Tokenize, cut_to_tokens, repeat_to_tokens
from polykv_py.jsontypes import Json
from polykv_py.llama_server import LlamaServer
from polykv_py.results import FanoutResult

from .machine import cpu_model, load_avg
from .systems import System

log = logging.getLogger(__name__)

FILLER = (
    "Agents review the design of a telemetry pipeline: gateways, a replicated log, a live view and a history "
    "store, with the failure modes, the costs and the rollout plan each of them brings along. "
)


# --------------------------------------------------------------------------- inputs
def base_text(target_tokens: int, tokenize: Tokenize, detokenize: Detokenize) -> str:
    """A text of about ``target_tokens`` tokens: the sample document (package data), repeated and cut."""
    return repeat_to_tokens(sample_document(), target_tokens, tokenize, detokenize)


def suffix_text(i: int, target_tokens: int, tokenize: Tokenize, detokenize: Detokenize, round_: int = 0) -> str:
    """Agent ``i``'s distinct suffix of about ``target_tokens`` tokens for round ``round_``."""
    head = f"\n\nReviewer {i + 1}, question {i * 7 + 3 + 100 * round_}: "
    return cut_to_tokens(head + FILLER * 4, target_tokens, tokenize, detokenize)


def ctx_for(n: int, p: int, s: int, g: int) -> int:
    """KV cells for N agents and the base, each with its own copy (what the reference needs)."""
    return round_up((n + 1) * (p + s + g + 16), 256)


def round_up(cells: int, step: int = 256) -> int:
    """``cells`` rounded up to a multiple of ``step`` (KV sizes are given in 256-cell pages)."""
    return -(-cells // step) * step


def matched_budget(n: int, p: int, s: int, g: int) -> tuple[int, int]:
    """(KV cells, slots) for the reference held to the patched server's budget.

    The budget is the sharing bound ``P + N*(S+G+16)`` plus 64, rounded up to 256; the
    slots are the whole prompts that fit in it side by side (at least one).
    """
    cells = round_up(p + n * (s + g + 16) + 64, 256)
    return cells, max(1, min(n, cells // (p + s + g + 16)))


class PeakRSS:
    """Samples a server's resident memory in a thread; ``peak`` in bytes."""

    def __init__(self, server: LlamaServer, every: float = 0.25) -> None:
        self.server, self.every, self.peak = server, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.server.usage().rss_bytes)
            except Exception as exc:  # a sampler must not kill the bench
                log.debug("RSS sample failed: %s", exc)
            self._stop.wait(self.every)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def round_summary(res: FanoutResult, kv_peak: int | None, rss: int | None, metrics_delta: dict[str, float]) -> Json:
    """The numbers of one round."""
    from_start = [a.started_s + a.ttft_s for a in res.agents if a.ttft_s is not None]
    errors = [a.error for a in res.agents if a.error]
    return {
        "wall_s": round(res.wall_s, 3),
        "prime_s": round(sum(p.wall_s for p in res.primes), 3),
        "ttft_mean_s": round(mean(from_start), 3) if from_start else None,
        "ttft_p50_s": round(median(from_start), 3) if from_start else None,
        "ttft_max_s": round(max(from_start), 3) if from_start else None,
        "ttft_from": "fan-out start (priming included)",
        "prompt_tokens_processed": res.tokens_processed,
        "prompt_tokens_metrics": int(metrics_delta.get("llamacpp:prompt_tokens_total", -1)),
        "prefix_tokens": res.prefix_tokens,
        "pool_tokens": res.pool_tokens,
        "mean_prompt_tokens": round(mean(a.n_prompt for a in res.agents), 1),
        "generated": sum(a.n_generated for a in res.agents),
        "kv_cells_peak": kv_peak,
        "rss_peak_mib": round(rss / 2**20, 1) if rss else None,
        "statuses": res.statuses,
        "errors": errors[:3],
        "n_errors": len(errors),
    }


def system_budget(spec: System, n: int, p: int, s: int, g: int) -> tuple[int, int, int]:
    """:func:`cell_budget` of a system recipe."""
    if spec.budget == "copies":
        return ctx_for(n, p, s, g), n + 1, n
    cells, slots = matched_budget(n, p, s, g)
    return (cells, n + 1, n) if spec.pool else (cells, slots, slots)


def make_inputs(server: LlamaServer, p: int, n: int, s: int, rounds: int = 1) -> tuple[str, list[list[str]]]:
    """The base text and, per round, every agent's suffix."""
    c = server.client
    tok = c.tokenize
    detok = c.detokenize
    return base_text(p, tok, detok), [[suffix_text(i, s, tok, detok, r) for i in range(n)] for r in range(rounds)]


def machine_info(threads: int) -> Json:
    """The machine a run was on, and its threads per server."""
    import psutil

    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_avg_start": load_avg(),
        "threads_per_server": threads,
    }

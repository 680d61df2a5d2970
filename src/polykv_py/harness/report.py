"""Plain-text and markdown tables for fan-out results and benchmarks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from statistics import mean
from typing import Any

from ..results import FanoutResult

Cell = str | int | float | None


def fmt(value: Cell, digits: int = 2) -> str:
    """One table cell: ints with thousands separators, floats rounded, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Cell]], *, markdown: bool = False) -> str:
    """Render rows as an aligned text table (numbers right-aligned) or a markdown table."""
    cells = [[fmt(c) for c in row] for row in rows]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals: Sequence[str]) -> str:
        out = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric, strict=True)]
        return ("| " + " | ".join(out) + " |") if markdown else "  ".join(out).rstrip()

    sep = (
        "|"
        + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric, strict=True))
        + "|"
        if markdown
        else "  ".join("-" * w for w in widths)
    )
    return "\n".join([line(list(headers)), sep, *(line(r) for r in cells)])


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def agents_table(result: FanoutResult, *, markdown: bool = False) -> str:
    """One row per agent: share status, P, tokens computed, generated, time to first token, latency."""
    routed = any(a.replica for a in result.agents)  # through a gateway: which replica answered
    rows = [
        [a.name, *([a.replica] if routed else []), a.status, a.requested, a.n_prompt, a.processed, a.n_generated,
         a.ttft_s, a.latency_s]
        for a in result.agents
    ]  # fmt: skip
    headers = ["agent", *(["replica"] if routed else []), "share", "P", "prompt tok", "computed", "generated",
               "TTFT s", "latency s"]  # fmt: skip
    return table(headers, rows, markdown=markdown)


def summary_rows(result: FanoutResult, baseline: FanoutResult | None = None) -> list[list[Cell]]:
    """Rows of the summary: metric, with sharing, without sharing."""
    ttfts = [a.ttft_s for a in result.agents if a.ttft_s is not None]
    base_ttfts = [a.ttft_s for a in baseline.agents if a.ttft_s is not None] if baseline else []
    kv_without: Cell = baseline.kv_cells_peak if baseline and baseline.kv_cells_peak is not None else None
    rows: list[list[Cell]] = [
        ["agents", len(result.agents), len(baseline.agents) if baseline else len(result.agents)],
        ["prefix tokens (P, shared)", result.prefix_tokens, 0],
        ["pool (templated base) tokens", result.pool_tokens, None],
        [
            "prompt tokens processed",
            result.tokens_processed,
            baseline.tokens_processed if baseline else result.tokens_without_sharing,
        ],
        ["KV cells in use (peak, measured)", result.kv_cells_peak, kv_without],
        ["KV cells, all agents resident (model)", result.kv_cells_with_sharing, result.kv_cells_without_sharing],
        ["wall time s (priming included)", result.wall_s, baseline.wall_s if baseline else None],
        ["mean time to first token s", mean(ttfts) if ttfts else None, mean(base_ttfts) if base_ttfts else None],
    ]
    return rows


def summary_table(result: FanoutResult, baseline: FanoutResult | None = None, *, markdown: bool = False) -> str:
    """The summary table. Without ``baseline`` the 'without sharing' column is the arithmetic
    (every agent computes and holds its whole prompt); with it, the measured baseline run."""
    label = "without sharing (measured)" if baseline else "without sharing (computed)"
    return table(["", "with sharing", label], summary_rows(result, baseline), markdown=markdown)


def statuses_line(result: FanoutResult) -> str:
    """``hit 7, own_cache 1`` and the primes."""
    parts = ", ".join(f"{k} {v}" for k, v in sorted(result.statuses.items()))
    restored = sum(p.restored_from is not None for p in result.primes)
    primes = len(result.primes) - restored
    line = f"share statuses: {parts}; pool primed {primes} time{'s' if primes != 1 else ''}"
    return line + (f", restored from the pool cache {restored} time{'s' if restored != 1 else ''}" if restored else "")


def dumps(doc: Any) -> str:
    """JSON for machines (stable key order, 2-space indent)."""
    return json.dumps(doc, indent=2, sort_keys=False, default=str)

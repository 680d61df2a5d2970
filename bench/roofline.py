"""The decode step's prefix attention against the machine's FP32 peak, measured in one run.

The path's rate in the server comes from two step cells that differ only in P: the step with the
larger pool minus the step with the smaller one is the time of the extra cells' attention (and of
whatever else grows with P). Its arithmetic, as ``polykv-fattn-check --bench`` counts it: per
(token, cell, query head) a DK-wide dot product and a DV-wide axpy, 2 flops per multiply-add, times
the model's layers. The peak is ``polykv-fattn-check --bench``'s FP32 FMA peak on as many threads
(independent FMA chains of the widest vectors the CPU has), taken with the node's own rate at the
ggml level, at the start and the end of the benchmark.
"""

from __future__ import annotations

import json
import logging
import subprocess
from dataclasses import dataclass
from statistics import median
from typing import Any

from polykv_py.models import resolve_model
from polykv_py.native import NATIVE_DIR

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionShape:
    """What the attention's arithmetic depends on: layers, query heads, K and V widths."""

    n_layer: int
    n_head: int
    dk: int
    dv: int

    def gflop(self, cells: int, tokens: int) -> float:
        """GFLOP of ``tokens`` query tokens over ``cells`` cells in every layer."""
        return cells * tokens * self.n_head * 2 * (self.dk + self.dv) * self.n_layer / 1e9


def attention_shape(model: str | None) -> AttentionShape:
    """The model's attention shape from its GGUF header (the ``gguf`` package, in the test extra)."""
    try:
        import gguf
    except ImportError as e:
        raise RuntimeError("the roofline needs the gguf package: pip install 'polykv[test]'") from e
    reader = gguf.GGUFReader(resolve_model(model))
    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()

    def value(key: str) -> int | None:
        field = reader.fields.get(f"{arch}.{key}")
        return None if field is None else int(field.parts[field.data[0]][0])

    n_head = value("attention.head_count")
    n_embd = value("embedding_length")
    n_layer = value("block_count")
    if n_head is None or n_embd is None or n_layer is None:
        raise RuntimeError(f"{arch} model without head count, embedding length or block count")
    dk = value("attention.key_length") or n_embd // n_head
    dv = value("attention.value_length") or n_embd // n_head
    return AttentionShape(n_layer, n_head, dk, dv)


def kernel_bench(threads: int, n: int = 16, cells: int = 4096, *, cold: bool = False) -> dict[str, Any]:
    """``polykv-fattn-check --bench``: one node of ``cells`` shared cells and ``n`` tokens at the default model's
    heads, both kernels, and the FP32 FMA peak on ``threads`` threads (``cold``: 64 MiB read by each thread before
    every computation, as a server's weights pass through the caches between two attention nodes)."""
    exe = NATIVE_DIR / "bin" / "polykv-fattn-check"
    args = [str(exe), "--bench", str(n), str(cells), str(threads), "0", "prefix"] + (["cold"] if cold else [])
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{exe} --bench failed ({proc.returncode}): {proc.stderr[-1000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


#: the two cold nodes whose difference predicts the step's extra cells (the default grid's two pools)
COLD_CELLS = (256, 4096)


def kernel_readings(threads: int) -> dict[str, Any]:
    """The node warm (repeated: its K/V and scratch stay in the caches), and cold at :data:`COLD_CELLS` cells."""
    warm = kernel_bench(threads)
    lo, hi = (kernel_bench(threads, cells=c, cold=True) for c in COLD_CELLS)
    return {**warm, "cold": {"cells": list(COLD_CELLS), "ms_on": [lo["ms_on"], hi["ms_on"]],
                             "ms_off": [lo["ms_off"], hi["ms_off"]]}}  # fmt: skip


def node_prediction(doc: dict[str, Any], shape: AttentionShape, system: str, n: int, cells: int) -> float | None:
    """ms per step that ``cells`` more cells cost in ``shape.n_layer`` cold nodes: the two cold nodes' difference
    per cell (the median over the run's readings), so what every node pays once (scratch, queries, partials
    refilled) cancels as it does between two pools. None without cold readings or for another N."""
    key = "ms_on" if system == "shared_decode" else "ms_off"
    per_cell = []
    for k in doc.get("kernel", []):
        cold = k.get("cold")
        if cold and k.get("N") == n:
            (c_lo, c_hi), (t_lo, t_hi) = cold["cells"], cold[key]
            per_cell.append((t_hi - t_lo) / (c_hi - c_lo))
    if not per_cell:
        return None
    return round(sorted(per_cell)[len(per_cell) // 2] * cells * shape.n_layer, 2)


def round_differences(lo: dict[str, Any], hi: dict[str, Any]) -> list[float]:
    """The larger pool's step minus the smaller's, round by round (:func:`bench.decode.run_grid` runs every cell once
    per round, so the host's drift cancels); empty unless both cells have the same number of runs, at least 2."""
    a, b = lo.get("step_ms_runs") or [], hi.get("step_ms_runs") or []
    if len(a) != len(b) or len(a) < 2:
        return []
    return [y - x for x, y in zip(a, b, strict=True)]


def _best(doc: dict[str, Any], key: str) -> float | None:
    """The highest of the run's kernel readings of ``key`` (a lower one is the machine disturbed)."""
    got = [k[key] for k in doc.get("kernel", []) if (k.get(key) or 0) > 0]
    return max(got) if got else None


def rows(doc: dict[str, Any], shape: AttentionShape) -> list[dict[str, Any]]:
    """For each (N, G) with two pools, the extra cells' attention rate in the server with the path on and off,
    against the FP32 peak the run measured (the higher of its readings: a lower one is the machine disturbed). The
    extra time is the median of the rounds' differences where the run has them, else the medians' difference."""
    peak = _best(doc, "fma_peak_gflops")
    steps: dict[tuple[str, int, int], dict[int, dict[str, Any]]] = {}
    for c in doc["cells"]:
        if c["kind"] == "step":
            steps.setdefault((c["system"], c["n"], c["gen"]), {})[c["p"]] = c
    out = []
    for (system, n, gen), by_p in sorted(steps.items()):
        if len(by_p) < 2:
            continue
        p_lo, p_hi = min(by_p), max(by_p)
        extra_runs = round_differences(by_p[p_lo], by_p[p_hi])
        extra_ms = median(extra_runs) if extra_runs else by_p[p_hi]["step_ms"] - by_p[p_lo]["step_ms"]
        gflop = shape.gflop(p_hi - p_lo, n)
        rate = gflop / (extra_ms / 1e3) if extra_ms > 0 else None
        out.append(
            {
                "system": system,
                "n": n,
                "gen": gen,
                "p_lo": p_lo,
                "p_hi": p_hi,
                "extra_ms": round(extra_ms, 2),
                "extra_ms_runs": [round(x, 2) for x in extra_runs],
                "gflop": round(gflop, 3),
                "gflops": None if rate is None else round(rate, 1),
                "peak_gflops": peak,
                "of_peak": None if rate is None or not peak else round(rate / peak, 3),
                "nodes_ms": node_prediction(doc, shape, system, n, p_hi - p_lo),
            }
        )
    return out


def path_run(t: dict[str, int], step_ms: float, shape: AttentionShape, threads: int) -> dict[str, Any] | None:
    """One fan-out's path counters (``bench.decode.path_time``) as per-step time and rates of ``threads`` threads:
    the nodes' wall ms per step (steps = ops / layers), shared tiles' GFLOP/s, private pairs' GB/s."""
    steps = t["ops"] / shape.n_layer
    if steps <= 0 or t["node_ns"] <= 0:
        return None
    path_ms = t["node_ns"] / 1e6 / steps
    return {
        "path_ms": round(path_ms, 2),
        "path_of_step": round(path_ms / step_ms, 3) if step_ms else None,
        "shared_gflops": round(t["shared_flop"] * threads / t["shared_ns"], 1) if t["shared_ns"] else None,
        "private_gbs": round(t["private_bytes"] * threads / t["private_ns"], 2) if t["private_ns"] else None,
    }


def path_rows(doc: dict[str, Any], shape: AttentionShape) -> list[dict[str, Any]]:
    """For each step cell with the path on, its own time in the server (the kernel's counters over the fan-outs):
    the nodes' ms per step and their share of the step, the shared tiles' rate against the run's FP32 peak and the
    private pairs' bytes against its read bandwidth; medians of the runs, every run kept."""
    threads = doc["config"]["threads"]
    peak, read = _best(doc, "fma_peak_gflops"), _best(doc, "read_gbs")
    out = []
    for c in doc["cells"]:
        if c["kind"] != "step" or c["system"] != "shared_decode":
            continue
        timed = zip(c.get("path_time_runs") or [], c.get("step_ms_runs") or [], strict=False)
        runs = [r for r in (path_run(t, ms, shape, threads) for t, ms in timed if t) if r]
        if not runs:
            continue

        def mid(key: str, runs: list[dict[str, Any]] = runs) -> float | None:
            got = [r[key] for r in runs if r[key] is not None]
            return round(median(got), 3) if got else None

        shared, private = mid("shared_gflops"), mid("private_gbs")
        out.append(
            {
                "n": c["n"], "gen": c["gen"], "p": c["p"], "step_ms": c["step_ms"],
                "path_ms": mid("path_ms"), "path_of_step": mid("path_of_step"),
                "shared_gflops": shared, "peak_gflops": peak,
                "shared_of_peak": round(shared / peak, 3) if shared and peak else None,
                "private_gbs": private, "read_gbs": read,
                "private_of_read": round(private / read, 3) if private and read else None,
                "runs": runs,
            }
        )  # fmt: skip
    return out

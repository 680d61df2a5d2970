"""The decode benchmark's roofline: the attention's arithmetic, the rate from two pools, the report's tables."""

from __future__ import annotations

from typing import Any

import pytest

from bench import decode
from bench.roofline import AttentionShape, attention_shape, path_rows, rows

#: The default model's attention (SmolLM2 135M: 30 layers, 9 query heads of 64).
DEFAULT_SHAPE = AttentionShape(n_layer=30, n_head=9, dk=64, dv=64)


def _cell(system: str, p: int, step_ms: float, *, n: int = 16, gen: int = 128, texts: list[str] | None = None) -> Any:
    return {"system": system, "kind": "step", "p": p, "n": n, "gen": gen, "step_ms": step_ms, "wall_s": 1.0,
            "texts": texts or ["same"] * n}  # fmt: skip


def _doc(cells: list[dict[str, Any]], peaks: tuple[float, float] = (500.0, 480.0)) -> dict[str, Any]:
    kernel = [
        {"ms_on": 0.6, "ms_off": 5.0, "gflops_on": 250.0, "on_of_peak": 0.5, "fma_peak_gflops": pk} for pk in peaks
    ]
    return {"config": {"gen": 128, "gens": [128, 512], "repeat": 1, "threads": 2},
            "machine": {"cpu": "test", "logical_cpus": 2, "load_avg_start": [0.1, 0.1, 0.1]},
            "cells": cells, "kernel": kernel}  # fmt: skip


def test_attention_arithmetic_matches_the_kernel_checks_count() -> None:
    # 3,840 cells x 16 tokens x 9 heads x 256 flops x 30 layers: the 4.25 GFLOP of docs/benchmarks.md
    assert DEFAULT_SHAPE.gflop(4096 - 256, 16) == pytest.approx(4.246732800)


def test_the_default_models_shape_is_read_from_its_header() -> None:
    assert attention_shape(None) == DEFAULT_SHAPE


def test_rate_from_two_pools_against_the_higher_peak() -> None:
    doc = _doc([_cell("shared_decode", 256, 48.0), _cell("shared_decode", 4096, 68.0),
                _cell("patched", 256, 56.0), _cell("patched", 4096, 168.0)])  # fmt: skip
    out = {r["system"]: r for r in rows(doc, DEFAULT_SHAPE)}
    on = out["shared_decode"]
    assert on["extra_ms"] == 20.0 and on["peak_gflops"] == 500.0
    assert on["gflops"] == pytest.approx(4.2467328 / 0.020, rel=1e-3)
    assert on["of_peak"] == pytest.approx(4.2467328 / 0.020 / 500.0, abs=1e-3)
    assert out["patched"]["gflops"] == pytest.approx(4.2467328 / 0.112, rel=1e-3)


def test_no_rate_without_two_pools_or_when_the_larger_pool_is_not_slower() -> None:
    assert rows(_doc([_cell("shared_decode", 4096, 68.0)]), DEFAULT_SHAPE) == []
    (r,) = rows(_doc([_cell("shared_decode", 256, 50.0), _cell("shared_decode", 4096, 49.0)]), DEFAULT_SHAPE)
    assert r["gflops"] is None and r["of_peak"] is None


def test_report_shows_growth_with_g_differences_and_the_roofline() -> None:
    off_texts, on_texts = ["abc"] * 16, ["abc"] * 15 + ["abx"]
    cells = [
        _cell("patched", 256, 56.0), _cell("shared_decode", 256, 48.0),
        _cell("patched", 4096, 168.0), _cell("shared_decode", 4096, 68.0),
        _cell("patched", 4096, 180.0, gen=512, texts=off_texts),
        _cell("shared_decode", 4096, 70.0, gen=512, texts=on_texts),
    ]  # fmt: skip
    doc = _doc(cells)
    doc["roofline"] = rows(doc, DEFAULT_SHAPE)
    md = decode.markdown(doc)
    assert "128, 512 greedy tokens per agent" in md
    assert "+2.9%" in md  # 70 / 68 - 1: the step's growth from G = 128 to 512 at P = 4,096
    assert "15/16" in md and "char 2" in md
    assert "FP32 FMA peak 500.0 GFLOP/s" in md and "256 -> 4,096" in md


def test_cold_nodes_predict_the_extra_cells_per_system() -> None:
    doc = _doc([_cell("shared_decode", 256, 76.0), _cell("shared_decode", 4096, 105.0),
                _cell("patched", 256, 91.0), _cell("patched", 4096, 299.0)])  # fmt: skip
    for k, (on, off) in zip(doc["kernel"], (((0.4, 1.2), (1.0, 7.0)), ((0.4, 1.3), (1.0, 8.0))), strict=True):
        k.update({"N": 16, "n_kv": 4096, "cold": {"cells": [256, 4096], "ms_on": on, "ms_off": off}})
    out = {r["system"]: r for r in rows(doc, DEFAULT_SHAPE)}
    # the median of two readings is the upper one; the nodes' difference is the pools' (3,840 cells), 30 layers
    assert out["shared_decode"]["nodes_ms"] == pytest.approx(0.9 * 30, abs=0.01)
    assert out["patched"]["nodes_ms"] == pytest.approx(7.0 * 30, abs=0.01)
    md = decode.markdown({**doc, "roofline": rows(doc, DEFAULT_SHAPE)})
    assert "cold nodes of 256 and 4,096 cells 0.4 / 1.2 ms on, 1.0 / 7.0 ms upstream" in md
    assert "|         27.00 |" in md


def test_no_node_prediction_without_cold_readings_or_for_another_n() -> None:
    doc = _doc([_cell("shared_decode", 256, 50.0, n=4), _cell("shared_decode", 4096, 60.0, n=4)])
    assert rows(doc, DEFAULT_SHAPE)[0]["nodes_ms"] is None
    for k in doc["kernel"]:
        k.update({"N": 16, "n_kv": 4096, "cold": {"cells": [256, 4096], "ms_on": [0.4, 1.2], "ms_off": [1.0, 7.0]}})
    assert rows(doc, DEFAULT_SHAPE)[0]["nodes_ms"] is None


def test_extra_time_is_the_median_of_the_rounds_differences() -> None:
    # the host slowed down over rounds 2 and 3: the medians' difference (80 - 60) hides what each round measured
    lo, hi = _cell("shared_decode", 256, 60.0), _cell("shared_decode", 4096, 80.0)
    lo["step_ms_runs"], hi["step_ms_runs"] = [50.0, 70.0, 60.0], [75.0, 95.0, 80.0]
    (r,) = rows(_doc([lo, hi]), DEFAULT_SHAPE)
    assert r["extra_ms_runs"] == [25.0, 25.0, 20.0] and r["extra_ms"] == 25.0
    assert "| 25.0 (25.0, 25.0, 20.0) |" in "\n".join(decode.roofline_markdown({**_doc([lo, hi]), "roofline": [r]}))
    # runs that cannot be paired (another count): the medians' difference
    hi["step_ms_runs"] = [75.0, 95.0]
    (r,) = rows(_doc([lo, hi]), DEFAULT_SHAPE)
    assert r["extra_ms_runs"] == [] and r["extra_ms"] == 20.0


def test_path_time_from_the_kernels_counters_against_the_runs_peak_and_bandwidth() -> None:
    # two runs of one cell: 31 steps of 30 layers (930 ops), 2 threads
    first = {"ops": 930, "node_ns": 31 * 30 * 1_000_000, "shared_ns": 40_000_000, "private_ns": 10_000_000,
             "items_ns": 60_000_000, "shared_flop": 4_000_000_000, "private_flop": 10_000_000,
             "private_bytes": 100_000_000}  # fmt: skip
    second = first | {"node_ns": 31 * 30 * 1_200_000, "shared_ns": 50_000_000, "private_ns": 20_000_000,
                      "items_ns": 80_000_000}  # fmt: skip
    runs = [first, second]
    on = _cell("shared_decode", 4096, 80.0) | {"step_ms_runs": [75.0, 85.0], "path_time_runs": runs}
    doc = _doc([_cell("patched", 4096, 250.0), on])
    for k, gbs in zip(doc["kernel"], (20.0, 25.0), strict=True):
        k["read_gbs"] = gbs
    (row,) = path_rows(doc, DEFAULT_SHAPE)
    # 30 ms and 36 ms of nodes per step; 200 and 160 GFLOP/s (4 GFLOP in 20 and 25 ms of 2 threads); 20 and 10 GB/s
    assert [r["path_ms"] for r in row["runs"]] == [30.0, 36.0] and row["path_ms"] == 33.0
    assert [r["path_of_step"] for r in row["runs"]] == [0.4, round(36 / 85, 3)]
    assert row["shared_gflops"] == 180.0 and row["shared_of_peak"] == 0.36  # against the higher peak, 500
    assert row["private_gbs"] == 15.0 and row["private_of_read"] == 0.6  # against the higher bandwidth, 25 GB/s
    doc["path_time"] = [row]
    md = decode.markdown(doc)
    assert "The path's own time in the server" in md
    assert "|   80.00 |        33.00 | 41%     |         180.00 | 36%          |        15.00 | 60%  " in md


def test_no_path_time_without_counters_or_for_the_upstream_kernel() -> None:
    doc = _doc([_cell("patched", 4096, 250.0) | {"path_time_runs": [None]}, _cell("shared_decode", 4096, 80.0)])
    assert path_rows(doc, DEFAULT_SHAPE) == []

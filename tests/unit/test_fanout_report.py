"""KV-cells log parsing, tables and the benchmark report, on synthetic inputs."""

from __future__ import annotations

from pathlib import Path

from bench import fanout_report
from bench.common import ctx_for, matched_budget
from polykv_py.harness.kvcells import KVCellsLog, parse_used
from polykv_py.harness.report import fmt, ratio, table

LINE = "0.27.638.272 D find_slot: stream[{s}], n = {n:5d}, used = {u:5d}, head = {n:5d}, size =  4096, n_swa = 0\n"


def test_parse_used_tracks_streams_and_peak() -> None:
    lines = [
        LINE.format(s=0, n=10, u=10).encode(),
        b"noise\n",
        LINE.format(s=1, n=5, u=5).encode(),
        LINE.format(s=0, n=12, u=3).encode(),
        b"srv  purging slot 2 with 100 tokens\n",
    ]
    reading, state = parse_used(lines)
    assert reading.peak == 15 and reading.last == 8 and reading.samples == 3 and reading.evictions == 1
    assert state == {0: 3, 1: 5}


def test_kv_cells_log_windows(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(LINE.format(s=0, n=100, u=100))
    kv = KVCellsLog(log)
    kv.mark()
    with open(log, "a") as f:
        f.write(LINE.format(s=0, n=150, u=150) + LINE.format(s=0, n=150, u=120) + "half a li")
    r = kv.read()
    assert (r.peak, r.last, r.samples) == (150, 120, 2)
    with open(log, "a") as f:
        f.write("ne\n")
    r = kv.read()
    assert (r.peak, r.last, r.samples) == (120, 120, 0)  # the window starts at the last value
    assert KVCellsLog(tmp_path / "missing.log").read().peak == 0


def test_table_and_cells() -> None:
    assert fmt(None) == "-" and fmt(1234) == "1,234" and fmt(1.5) == "1.50" and fmt("x") == "x"
    assert ratio(6.0, 2.0) == 3.0 and ratio(1.0, 0) is None and ratio(None, 1.0) is None
    text = table(["name", "n"], [["a", 1], ["bb", 22]])
    assert text.splitlines()[0].startswith("name") and text.splitlines()[2].endswith(" 1")
    md = table(["name", "n"], [["a", 1]], markdown=True)
    assert md.splitlines()[1].endswith(":|") and md.startswith("| name")


def test_ctx_for_rounds_up_to_256() -> None:
    assert ctx_for(1, 512, 64, 32) == 1280
    assert ctx_for(8, 2048, 64, 32) % 256 == 0 and ctx_for(8, 2048, 64, 32) >= 9 * (2048 + 96)


def test_matched_budget_fits_whole_prompts_side_by_side() -> None:
    cells, slots = matched_budget(8, 2048, 64, 32)
    assert cells == 3072 and slots == 1  # P + 8*112 + 64 = 3,008 -> 3,072; one 2,160-cell prompt fits
    cells, slots = matched_budget(16, 512, 64, 32)
    assert cells == 2560 and slots == 4 and slots * (512 + 112) <= cells
    assert matched_budget(1, 4096, 64, 32)[1] == 1
    assert matched_budget(2, 16, 64, 32)[1] == 2  # never more slots than agents


def _round(wall: float, tokens: int, kv: int) -> dict:
    return {
        "wall_s": wall,
        "prime_s": 0.0,
        "ttft_mean_s": 1.0,
        "prompt_tokens_processed": tokens,
        "prefix_tokens": 2048,
        "kv_cells_peak": kv,
        "rss_peak_mib": 200.0,
        "statuses": {"hit": 8},
        "n_errors": 0,
    }


def test_bench_markdown_headline(tmp_path: Path) -> None:
    doc = {
        "config": {
            "ns": [8],
            "ps": [2048],
            "suffix": 64,
            "gen": 32,
            "rounds": 2,
            "systems": ["stock", "stock_kvu", "stock_queued", "patched"],
            "quick": True,
        },
        "machine": {"cpu": "test cpu", "logical_cpus": 2, "threads_per_server": 2, "load_avg_start": [1, 1, 1]},
        "model": "/x/SmolLM2.gguf",
        "cells": [
            {"system": "stock", "n": 8, "p": 2048, "rounds": [_round(60.0, 16896, 17000), _round(30.0, 8, 17000)]},
            {"system": "stock_kvu", "n": 8, "p": 2048, "rounds": [_round(70.0, 16896, 17000), _round(3.0, 8, 1)]},
            {
                "system": "stock_queued",
                "n": 8,
                "p": 2048,
                "ctx": 3072,
                "slots": 1,
                "rounds": [_round(25.0, 2560, 2900), _round(7.0, 600, 2900)],
            },
            {"system": "patched", "n": 8, "p": 2048, "rounds": [_round(10.0, 2560, 2820), _round(1.0, 8, 2820)]},
        ],
        "capacity": [
            {
                "system": "patched",
                "ctx": 16384,
                "p": 4096,
                "predicted": 128,
                "candidates": [128, 129],
                "largest_fitting": 128,
                "smallest_failing": 129,
                "steps": [
                    {"n": 128, "fits": True, "kv_cells_peak": 16254, "kv_evictions": 0},
                    {"n": 129, "fits": False, "kv_cells_peak": 16384, "kv_evictions": 3},
                ],
            }
        ],
        "notes": ["engine skipped"],
    }
    md = fanout_report.markdown(doc)
    # round 1: the fastest stock system is the queued one (25 s); round 2: stock_kvu (3 s)
    assert "round 1 (priming included): 2.50x faster than the best stock system in this cell" in md
    assert "round 2 (a new question each): 3.00x faster than the best stock system" in md
    assert "vs stock, its defaults (KV streams): wall 6.00x" in md
    assert "best stock: stock_queued" in md
    assert "| 2,048 | 8 | stock at the sharing KV budget, queued |" in md
    assert "target P+N*S = 2,560" in md
    assert "largest N that fit = 128, smallest that failed = 129" in md
    assert "engine skipped" in md
    png = fanout_report.plot(doc, tmp_path / "x.png")
    assert png is None or png.exists()

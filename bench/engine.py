"""Benchmark: the in-process shared-prefix engine vs every agent from scratch (not a test).

For each N it runs, in one process and on the same model and threads:

* **shared**: ``SharedPrefixEngine`` with unified KV: the P-token prefix decoded once into
  sequence 0, shared into N sequences with ``seq_cp``, N suffixes of S tokens decoded
  together, then G tokens generated for all N agents in one batch per step;
* **from scratch**: the same engine with ``share=False`` on a context without unified KV
  (one KV stream per agent, like ``llama-server -np N``): every agent decodes its whole
  P+S prompt itself, then the same batched generation.

Generation ignores EOS so every agent produces exactly G tokens. It records wall time,
tokens processed (everything passed to ``llama_decode``) and KV cells in use at the end
(the peak; counted by parsing the context state, see docs/memory-api.md), and writes
``engine.json`` and ``engine.md`` to ``--out``.

    python -m bench.engine            # N in 1 2 4 8 16, P=2048, S=64, G=32
    python -m bench.engine --quick    # a tiny grid to check the script

On a machine busy with other jobs pass ``--threads 1``: ggml's thread barriers make
multi-threaded timings erratic when the cores are oversubscribed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from polykv_py.engine import EngineRunResult, GenerationParams, SharedPrefixEngine, context_params_for
from polykv_py.llama import ContextParams, Model, system_info
from polykv_py.native import build_info

from . import RESULTS
from .machine import cpu_model

log = logging.getLogger(__name__)

_WORDS = [
    "warehouse",
    "parcel",
    "driver",
    "route",
    "invoice",
    "refund",
    "supplier",
    "customer",
    "schedule",
    "shift",
    "report",
    "meeting",
    "budget",
    "forecast",
    "shipment",
    "delay",
    "contract",
    "tracking",
    "system",
    "office",
    "team",
    "manager",
    "policy",
    "quarter",
    "cost",
    "fuel",
    "truck",
    "depot",
    "order",
    "stock",
    "audit",
    "review",
    "plan",
    "week",
    "month",
    "region",
]


def _sentence(rng: random.Random, i: int) -> str:
    w = [rng.choice(_WORDS) for _ in range(rng.randint(6, 12))]
    return f"Note {i}: the {w[0]} {w[1]} for {w[2]} is {rng.randint(2, 999)} {' '.join(w[3:])}.\n"


def make_prefix(model: Model, n_tokens: int) -> list[int]:
    """Exactly ``n_tokens`` tokens of deterministic project-notes text."""
    rng, text, i = random.Random(0), "Project notes shared by every agent.\n", 0
    while len(model.tokenize(text)) < n_tokens:
        text += "".join(_sentence(rng, i + k) for k in range(20))
        i += 20
    return model.tokenize(text)[:n_tokens]


def make_suffixes(model: Model, n: int, n_tokens: int) -> list[list[int]]:
    """``n`` distinct suffixes of exactly ``n_tokens`` tokens (a question padded with context)."""
    out = []
    for k in range(n):
        rng = random.Random(1000 + k)
        text = f"\nAgent {k}, answer this question about note {rng.randint(1, 50)}: "
        while len(model.tokenize(text, add_special=False)) < n_tokens:
            text += " ".join(rng.choice(_WORDS) for _ in range(8)) + "? "
        out.append(model.tokenize(text, add_special=False)[:n_tokens])
    return out


def _summary(res: EngineRunResult, cells: int, cell_bytes: int) -> dict[str, Any]:
    return {
        "mode": res.mode,
        "wall_s": round(res.timings["wall_s"], 3),
        "phases_s": {k: round(v, 3) for k, v in res.timings.items() if k != "wall_s"},
        "tokens_processed": res.tokens_processed,
        "kv_cells_in_use": cells,
        "kv_bytes_in_use": cells * cell_bytes,
    }


def run_one(model: Model, n: int, pre: list[int], sufs: list[list[int]], g: int, base: ContextParams) -> dict[str, Any]:
    gp = GenerationParams(max_tokens=g, ignore_eos=True)
    p, s = len(pre), len(sufs[0])
    out: dict[str, Any] = {"n_agents": n}
    results = {}
    for name, share, unified in (("shared", True, True), ("scratch", False, False)):
        params = context_params_for(n, p, s, g, share=share, kv_unified=unified, base=base)
        with SharedPrefixEngine(model, params) as eng:
            res = eng.run(pre, sufs[:n], gp, share=share)
            usage = eng.ctx.memory.usage()
            out[name] = _summary(res, usage.cells, usage.cell_bytes)
            out[name]["n_ctx"] = eng.ctx.n_ctx
            results[name] = res
        log.info(
            "N=%d %s: %.2fs, %d tokens, %d cells", n, name, res.timings["wall_s"], res.tokens_processed, usage.cells
        )
    sh, sc = out["shared"], out["scratch"]
    sh["expected_tokens"] = p + n * (s + g)
    sc["expected_tokens"] = n * (p + s + g)
    out["compute_ratio"] = round(sc["tokens_processed"] / sh["tokens_processed"], 3)
    out["wall_ratio"] = round(sc["wall_s"] / sh["wall_s"], 3)
    out["kv_ratio"] = round(sc["kv_cells_in_use"] / sh["kv_cells_in_use"], 3)
    same = sum(a.tokens == b.tokens for a, b in zip(results["shared"].agents, results["scratch"].agents, strict=True))
    out["greedy_outputs_identical"] = f"{same}/{n}"
    return out


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError):  # not every platform has a load average
        info["loadavg_start"] = list(os.getloadavg())
    return info


def to_markdown(report: dict[str, Any]) -> str:
    cfg, m = report["config"], report["machine"]
    lines = [
        (
            f"Prefix P = {cfg['prefix_tokens']} tokens, suffix S = {cfg['suffix_tokens']} tokens per agent, "
            f"G = {cfg['generated_tokens']} generated tokens per agent (greedy, EOS ignored); "
            f"{cfg['threads']} threads, n_ubatch {cfg['n_ubatch']}, flash attention {cfg['flash_attn']}."
        ),
        (
            f"Machine: {m['cpu']}, {m['cpu_count']} logical CPUs, {m['platform']}; "
            f"load average at start {m.get('loadavg_start', ['?'])[0]}, at end {m.get('loadavg_end', ['?'])[0]}."
        ),
        "",
        (
            "| N | shared wall (s) | scratch wall (s) | wall ratio | shared tokens (P+N(S+G)) | scratch tokens "
            "| compute ratio | shared KV cells | scratch KV cells | greedy identical |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["runs"]:
        sh, sc = r["shared"], r["scratch"]
        lines.append(
            f"| {r['n_agents']} | {sh['wall_s']:.2f} | {sc['wall_s']:.2f} | {r['wall_ratio']:.2f} "
            f"| {sh['tokens_processed']} ({sh['expected_tokens']}) | {sc['tokens_processed']} "
            f"| {r['compute_ratio']:.2f} "
            f"| {sh['kv_cells_in_use']} | {sc['kv_cells_in_use']} | {r['greedy_outputs_identical']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny grid (N 1 2, P 256, S 16, G 8)")
    ap.add_argument("--model", help="GGUF path (default: the default model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-ubatch", type=int, default=512)
    ap.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--agents", type=int, nargs="+", help="override the N grid")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.quick:
        grid, p, s, g = [1, 2], 256, 16, 8
    else:
        grid, p, s, g = [1, 2, 4, 8, 16], 2048, 64, 32
    grid = args.agents or grid
    base = ContextParams(n_threads=args.threads, n_batch=2048, n_ubatch=args.n_ubatch, flash_attn=args.flash_attn)
    report: dict[str, Any] = {
        "benchmark": "engine",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {
            "prefix_tokens": p,
            "suffix_tokens": s,
            "generated_tokens": g,
            "agents": grid,
            "threads": args.threads,
            "n_batch": 2048,
            "n_ubatch": args.n_ubatch,
            "flash_attn": args.flash_attn,
            "shared": "SharedPrefixEngine, unified KV, prefix decoded once and shared with seq_cp",
            "scratch": "same engine, share=False, no unified KV (one stream per agent): every agent decodes P+S",
        },
        "runs": [],
    }
    t0 = time.perf_counter()
    with Model(args.model, n_gpu_layers=0) as model:
        report["model"] = {"path": str(model.path), "description": model.description, "sha256": model.sha256()}
        report["llama"] = {
            "system_info": system_info(),
            **{k: build_info().get(k) for k in ("upstream_commit", "patch_series_sha256")},
        }
        pre = make_prefix(model, p)
        sufs = make_suffixes(model, max(grid), s)
        for n in grid:
            report["runs"].append(run_one(model, n, pre, sufs, g, base))
    report["total_s"] = round(time.perf_counter() - t0, 1)
    with contextlib.suppress(OSError):
        report["machine"]["loadavg_end"] = list(os.getloadavg())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine.json").write_text(json.dumps(report, indent=2) + "\n")
    md = to_markdown(report)
    (args.out / "engine.md").write_text(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

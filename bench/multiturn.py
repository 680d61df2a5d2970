"""Multi-turn agents over one base: the workload where a shared base plus each agent's own cache pays.

N agents each run T turns over one base context of about P tokens (the sample design
document, package data). Turn t of agent i sends the base, the agent's own transcript so
far (its earlier questions and answers) and a new question about the base
(:data:`polykv_py.data.questions.QUESTIONS`), and generates G greedy tokens. The same
turns run on each :mod:`~bench.systems` system, on a fresh server per cell:

- at the *sharing* KV budget (``patched``, ``stock_queued``): the base once plus every
  agent's transcript, so the stock server can hold only a few whole prompts and queues;
- at *N copies* of it (the other systems): room for every agent's own copy of the base.

Per turn the report gives wall time, prompt tokens the server computed, TTFT p50/p95, peak
KV cells, share statuses and how many answers name the fact the question asks for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from polykv_py.client import AsyncClient
from polykv_py.data.questions import QUESTIONS
from polykv_py.errors import PolykvError
from polykv_py.fanout import Agent, BasePrompt, Fanout
from polykv_py.harness.kvcells import KVCellsLog
from polykv_py.llama_server import LlamaServer
from polykv_py.native import ServerKind
from polykv_py.results import FanoutResult

from . import RESULTS
from .common import base_text, round_up
from .machine import load_avg, machine
from .systems import SYSTEMS, System, best_stock, start_system_server

log = logging.getLogger(__name__)

#: Tokens a question block ("\n\nQuestion: ...\nAnswer:") takes at most (checked when inputs are made).
QUESTION_TOKENS = 32


@dataclass(frozen=True)
class TurnsConfig:
    """One multi-turn cell: N agents, T turns, P base tokens, G generated tokens per turn."""

    n: int
    turns: int
    p: int
    gen: int = 32
    threads: int = 2
    model: str | None = None
    timeout: float = 7200.0


def question_block(agent: int, turn: int) -> tuple[str, str]:
    """(the text agent ``agent`` adds at turn ``turn``, the fact its answer should name)."""
    q, fact = QUESTIONS[(agent * 7 + turn) % len(QUESTIONS)]
    return f"\n\nQuestion: {q}\nAnswer:", fact


def own_cells(turns: int, gen: int) -> int:
    """KV cells one agent's own transcript needs after ``turns`` turns (an upper bound)."""
    return turns * (QUESTION_TOKENS + gen)


def budget(system: System, cfg: TurnsConfig) -> tuple[int, int]:
    """(KV cells, slots) for a system in a cell.

    ``shared``: the base once plus every agent's transcript and a margin of 64, rounded up to
    256; the patched server gets a slot per agent plus the pool, the stock server as many slots
    as whole transcripts (base included) fit. ``copies``: a slot per agent plus one, each with
    room for the base and a whole transcript.
    """
    own = own_cells(cfg.turns, cfg.gen) + 16
    whole = cfg.p + own
    if system.budget == "shared":
        cells = round_up(cfg.p + cfg.n * own + 64, 256)
        slots = cfg.n + 1 if system.pool else max(1, min(cfg.n, cells // whole))
        return cells, slots
    per_slot = round_up(whole, 256)
    return (cfg.n + 1) * per_slot, cfg.n + 1


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[k]


def turn_summary(res: FanoutResult, facts: Sequence[str], kv_peak: int | None) -> dict[str, Any]:
    """The numbers of one turn (TTFT measured from the turn's start)."""
    ttft = [a.started_s + a.ttft_s for a in res.agents if a.ttft_s is not None]
    named = sum(1 for a, fact in zip(res.agents, facts, strict=True) if fact.lower() in a.text.lower())
    p50, p95 = median(ttft) if ttft else None, _percentile(ttft, 0.95)
    return {
        "wall_s": round(res.wall_s, 3),
        "prime_s": round(sum(p.wall_s for p in res.primes), 3),
        "prompt_tokens_processed": res.tokens_processed,
        "ttft_p50_s": None if p50 is None else round(p50, 3),
        "ttft_p95_s": None if p95 is None else round(p95, 3),
        "kv_cells_peak": kv_peak,
        "statuses": res.statuses,
        "answers_naming_the_fact": named,
        "n_errors": sum(1 for a in res.agents if a.error),
        "errors": [a.error for a in res.agents if a.error][:2],
    }


async def run_turns(sc: Fanout, kv: KVCellsLog, cfg: TurnsConfig, *, prime: bool) -> list[dict[str, Any]]:
    """Every turn of every agent on one server; each agent's answers join its own transcript."""
    params = {"n_predict": cfg.gen, "ignore_eos": True, "temperature": 0.0}
    transcripts = [""] * cfg.n
    turns = []
    for t in range(cfg.turns):
        blocks = [question_block(i, t) for i in range(cfg.n)]
        agents = [
            Agent(transcripts[i] + q, name=f"a{i}", mode="completion", params=params) for i, (q, _) in enumerate(blocks)
        ]
        kv.mark()
        res = await sc.run(agents, prime=prime and t == 0)
        await asyncio.sleep(0.3)  # the last micro-batch's log line
        turns.append(turn_summary(res, [fact for _, fact in blocks], kv.read().peak))
        for a in res.agents:
            transcripts[a.index] += blocks[a.index][0] + a.text
    return turns


def run_cell(system_name: str, cfg: TurnsConfig, base: str) -> dict[str, Any]:
    """All turns of one system, on a fresh server."""
    system = SYSTEMS[system_name]
    cells, slots = budget(system, cfg)
    concurrency = slots - 1 if system.pool else slots
    server = start_system_server(
        system, slots, cells, model=cfg.model, threads=cfg.threads, name=f"turns-{system.name}"
    )
    try:

        async def go() -> list[dict[str, Any]]:
            async with AsyncClient(server.url, server=server, timeout=cfg.timeout) as client:
                sc = Fanout(client, BasePrompt.from_text(base), share=system.share, concurrency=min(concurrency, cfg.n))
                return await run_turns(sc, KVCellsLog(server.log_path), cfg, prime=system.prime)

        turns = asyncio.run(asyncio.wait_for(go(), cfg.timeout))
    finally:
        server.stop()
    return {
        "system": system_name,
        "n": cfg.n,
        "turns": cfg.turns,
        "p": cfg.p,
        "ctx": cells,
        "slots": slots,
        "server_args": server.args,
        "per_turn": turns,
        "wall_s": round(sum(t["wall_s"] for t in turns), 3),
        "prompt_tokens_processed": sum(t["prompt_tokens_processed"] for t in turns),
        "kv_cells_peak": max((t["kv_cells_peak"] or 0 for t in turns), default=None),
    }


# --------------------------------------------------------------------------- grid and report
#: Turns after which the report shows cumulative numbers (the issue's T in {1, 4, 16}).
CHECKPOINTS = (1, 4, 16)


def base_for(p: int, model: str | None = None) -> str:
    """A base of about ``p`` tokens (the sample document repeated and cut), tokenized by a small server
    of ``model`` (default: the default model)."""
    with LlamaServer(
        kind=ServerKind.UPSTREAM, model=model, args=["-np", "1", "-c", "512"], threads=1, name="turns-tokenizer"
    ) as srv:
        return base_text(p, srv.client.tokenize, srv.client.detokenize)


def run_grid(
    ns: Sequence[int],
    turns: int,
    ps: Sequence[int],
    systems: Sequence[str],
    *,
    gen: int = 32,
    threads: int = 2,
    model: str | None = None,
    out_dir: Path = RESULTS / "turns",
    say: Callable[[str], None] = log.info,
    timeout: float = 7200.0,
) -> dict[str, Any]:
    """Every (P, N, system) cell for ``turns`` turns; writes turns.json and turns.md after each cell."""
    doc: dict[str, Any] = {
        "config": {
            "ns": list(ns),
            "turns": turns,
            "ps": list(ps),
            "systems": list(systems),
            "gen": gen,
            "threads": threads,
            "question_tokens_max": QUESTION_TOKENS,
        },
        "machine": machine(),
        "systems": {name: SYSTEMS[name].label for name in systems},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cells": [],
    }
    for p in ps:
        base = base_for(p, model)
        for n in ns:
            cfg = TurnsConfig(n, turns, p, gen, threads, model, timeout)
            for name in systems:
                say(f"turns: {name} N={n} P={p} T={turns} ...")
                t0 = time.perf_counter()
                try:
                    cell = run_cell(name, cfg, base)
                except TimeoutError:
                    cell = {"system": name, "n": n, "turns": turns, "p": p, "error": f"timeout: over {timeout:.0f} s"}
                except PolykvError as exc:
                    cell = {"system": name, "n": n, "turns": turns, "p": p, "error": str(exc)[:800]}
                doc["cells"].append(cell)
                say(f"turns: {name} N={n} P={p}: {cell.get('wall_s', 'error')} s in {time.perf_counter() - t0:.0f} s")
                write(doc, out_dir)
    doc["machine"]["load_avg_end"] = load_avg()
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write(doc, out_dir)
    return doc


def write(doc: dict[str, Any], out_dir: Path) -> None:
    """turns.json and turns.md in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "turns.json").write_text(json.dumps(doc, indent=2))
    (out_dir / "turns.md").write_text(markdown(doc))


def _cumulative(cell: dict[str, Any], t: int, key: str) -> float | None:
    per_turn = cell.get("per_turn") or []
    if len(per_turn) < t:
        return None
    return sum(x[key] for x in per_turn[:t])


def markdown(doc: dict[str, Any]) -> str:
    """One table per (P, N): each system's cumulative wall time and work after 1, 4 and 16 turns."""
    from polykv_py.harness.report import ratio, table

    lines = [
        "# Multi-turn agents over one base",
        "",
        f"Machine: {doc['machine']['cpu']}, {doc['machine']['logical_cpus']} logical CPUs, "
        f"load average at start {doc['machine']['load_avg_start']}"
        + (f", at end {doc['machine']['load_avg_end']}" if "load_avg_end" in doc["machine"] else "")
        + ".",
        f"Each turn: a new question about the base plus the agent's own transcript; {doc['config']['gen']} "
        "greedy tokens per answer. Wall times are cumulative over the turns; the first turn includes priming.",
        "",
        "Systems: " + "; ".join(f"`{k}`: {v}" for k, v in doc["systems"].items()),
        "",
        *[f"- {note}" for note in doc.get("notes", [])],
        *([""] if doc.get("notes") else []),
    ]
    keys = sorted({(c["p"], c["n"]) for c in doc["cells"]})
    for p, n in keys:
        cells = {c["system"]: c for c in doc["cells"] if (c["p"], c["n"]) == (p, n)}
        checkpoints = [t for t in CHECKPOINTS if t <= doc["config"]["turns"]]
        rows: list[list[Any]] = []
        for name, cell in cells.items():
            if "error" in cell:
                rows.append([name, cell["error"][:60], *[None] * (2 * len(checkpoints) + 2)])
                continue
            last = cell["per_turn"][-1]
            rows.append(
                [
                    name,
                    *[_cumulative(cell, t, "wall_s") for t in checkpoints],
                    *[_cumulative(cell, t, "prompt_tokens_processed") for t in checkpoints],
                    last["ttft_p50_s"],
                    last["ttft_p95_s"],
                    cell["kv_cells_peak"],
                ]
            )
        best = {
            t: best_stock({k: _cumulative(c, t, "wall_s") for k, c in cells.items() if "error" not in c})
            for t in checkpoints
        }
        patched = cells.get("patched")
        rows.append(
            [
                "best stock",
                *[f"{b[1]:.1f} ({b[0]})" if b else None for b in best.values()],
                *[None] * (len(checkpoints) + 3),
            ]
        )
        if patched and "error" not in patched:
            walls = [b[1] if b is not None else None for b in best.values()]
            rows.append(
                [
                    "patched x vs best stock",
                    *[ratio(w, _cumulative(patched, t, "wall_s")) for w, t in zip(walls, checkpoints, strict=True)],
                    *[None] * (len(checkpoints) + 3),
                ]
            )
        headers = [
            "system",
            *[f"wall s, T={t}" for t in checkpoints],
            *[f"prompt tok, T={t}" for t in checkpoints],
            "TTFT p50 s (last turn)",
            "TTFT p95 s (last turn)",
            "KV peak",
        ]
        lines += [f"## P = {p:,}, N = {n}", "", table(headers, rows, markdown=True), ""]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.multiturn``: run the multi-turn grid."""
    ap = argparse.ArgumentParser(
        prog="python -m bench.multiturn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, nargs="+", default=[4, 16], help="agents (default 4 16)")
    ap.add_argument("--turns", type=int, default=16, help="turns per agent (default 16)")
    ap.add_argument("--p", type=int, nargs="+", default=[2048, 4096], help="base tokens (default 2048 4096)")
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    ap.add_argument("--gen", type=int, default=32, help="greedy tokens per answer (default 32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", "-m")
    ap.add_argument("--out", type=Path, default=RESULTS / "turns")
    ap.add_argument(
        "--cell-timeout", type=float, default=7200.0, help="seconds one system may take for a cell (default 7200)"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    run_grid(
        args.n,
        args.turns,
        args.p,
        args.systems,
        gen=args.gen,
        threads=args.threads,
        model=args.model,
        out_dir=args.out,
        timeout=args.cell_timeout,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The fan-out benchmark: ``python -m bench.fanout`` (``polykv bench`` in a source checkout).

For every N (agents) and P (base context tokens) it runs the same fan-out (S-token
suffixes, G generated tokens, greedy, ``ignore_eos``) on each system, each on a fresh
server (``-np``/``-c`` from the system's KV budget, debug KV logging for the cell count).
The systems are :mod:`bench.systems`' (the stock server in each of its useful
modes, polykv shared and copied), plus ``engine``, the in-process engine
(:mod:`polykv_py.engine`) in a child process. Reports name the fastest stock system per
cell ("best stock").

Round 2 (and later) asks the same N agents a new question each (same base, a different
S-token suffix) on the same server/engine, as agents working in rounds do. A capacity probe
finds the largest N that runs at ``-c 16384``, P = 4096 without eviction or error.
Writes ``fanout.json``, ``fanout.md`` and (with matplotlib) ``fanout.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, median
from typing import TYPE_CHECKING, Any

from polykv_py.client import AsyncClient
from polykv_py.errors import PolykvError
from polykv_py.fanout import Agent, BasePrompt, Fanout
from polykv_py.harness.kvcells import KV_METHOD, KVCellsLog
from polykv_py.jsontypes import Json
from polykv_py.llama_server import LlamaServer

from . import RESULTS
from .common import (
    PeakRSS,
    machine_info,
    make_inputs,
    round_summary,
    system_budget,
)
from .machine import load_avg
from .systems import SYSTEMS as SERVER_SYSTEMS
from .systems import start_system_server

if TYPE_CHECKING:  # the engine loads the native extension: only its cells import it
    from polykv_py.engine import GenerationParams
    from polykv_py.llama import ContextParams

log = logging.getLogger(__name__)


SYSTEMS = (*SERVER_SYSTEMS, "engine")
#: The capacity probe's systems: polykv, and the stock server whose KV holds the most whole prompts at a fixed -c.
CAPACITY_SYSTEMS = ("patched", "stock_kvu")


@dataclass
class BenchConfig:
    ns: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    ps: list[int] = field(default_factory=lambda: [512, 2048, 4096])
    suffix: int = 64
    gen: int = 32
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    rounds: int = 2
    threads: int = 2
    capacity: bool = True
    capacity_ctx: int = 16384
    capacity_p: int = 4096
    capacity_max: int = 128
    capacity_timeout: float = 900.0
    capacity_n: dict[str, list[int]] = field(default_factory=dict)  # explicit N to try per system
    capacity_only: bool = False
    cell_timeout: float = 3600.0
    out_dir: Path = RESULTS
    model: str | None = None
    quick: bool = False
    server_args: tuple[str, ...] = ()  # every server's, stock and patched alike (e.g. -ngl 99 on a GPU)


def _metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if "total" in k}


# --------------------------------------------------------------------------- server cells
def start_server(system: str, n_slots: int, ctx: int, cfg: BenchConfig) -> LlamaServer:
    """A started server for ``system`` with ``n_slots`` slots and ``ctx`` KV cells, logging its KV cells in use."""
    return start_system_server(
        SERVER_SYSTEMS[system],
        n_slots,
        ctx,
        model=cfg.model,
        threads=cfg.threads,
        name=f"bench-{system}",
        extra=cfg.server_args,
    )


def cell_budget(system: str, n: int, p: int, s: int, g: int) -> tuple[int, int, int]:
    """(KV cells, slots, agents in flight) of one cell: N private copies, or the sharing budget."""
    return system_budget(SERVER_SYSTEMS[system], n, p, s, g)


async def _fanout_round(ctx: Fanout, agents: list[Agent], kv: KVCellsLog, server: LlamaServer, prime: bool) -> Json:
    before = await ctx.client.metrics()
    kv.mark()
    with PeakRSS(server) as rss:
        res = await ctx.run(agents, prime=prime)
    await asyncio.sleep(0.3)
    reading = kv.read()
    after = await ctx.client.metrics()
    out = round_summary(res, reading.peak, rss.peak, _metrics_delta(before, after))
    out["kv_evictions"] = reading.evictions
    return out


def run_server_cell(system: str, n: int, p: int, cfg: BenchConfig) -> Json:
    """Every round of one (system, N, P) on a fresh server."""
    spec = SERVER_SYSTEMS[system]
    ctx_cells, slots, concurrency = cell_budget(system, n, p, cfg.suffix, cfg.gen)
    server = start_server(system, slots, ctx_cells, cfg)
    try:
        base, suffixes = make_inputs(server, p, n, cfg.suffix, cfg.rounds)
        params = {"n_predict": cfg.gen, "ignore_eos": True, "temperature": 0.0}

        async def go() -> list[Json]:
            async with AsyncClient(server.url, server=server, timeout=cfg.cell_timeout) as client:
                sc = Fanout(client, BasePrompt.from_text(base), share=spec.share, concurrency=concurrency)
                kv = KVCellsLog(server.log_path)
                rounds = []
                for r in range(cfg.rounds):
                    agents = [
                        Agent(sfx, name=f"a{i}", mode="completion", params=params) for i, sfx in enumerate(suffixes[r])
                    ]
                    prime = r == 0 and spec.prime
                    rounds.append(await _fanout_round(sc, agents, kv, server, prime))
                return rounds

        rounds = asyncio.run(asyncio.wait_for(go(), cfg.cell_timeout))
        return {
            "system": system,
            "n": n,
            "p": p,
            "ctx": ctx_cells,
            "slots": slots,
            "concurrency": concurrency,
            "server_args": server.args,
            "rounds": rounds,
            "_inputs": (base, suffixes),
        }
    finally:
        server.stop()


# --------------------------------------------------------------------------- engine cells
def run_engine_cell(n: int, p: int, cfg: BenchConfig, base: str, suffixes: list[list[str]]) -> Json:
    """Every round in the in-process engine, in a child process (its RSS is the engine's)."""
    job = {
        "n": n,
        "p": p,
        "suffix": cfg.suffix,
        "gen": cfg.gen,
        "rounds": cfg.rounds,
        "threads": cfg.threads,
        "model": cfg.model,
        "base": base,
        "suffixes": suffixes,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fanout", "--engine-cell", "-"],
        input=json.dumps(job),
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=cfg.cell_timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise PolykvError(f"engine cell failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child_env() -> dict[str, str]:
    """The environment of a child ``python -m bench.fanout``: this checkout first on its path, so the child
    imports the same ``bench`` package however the parent found it (``polykv bench`` or ``python -m``)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _last_lines(text: str, n: int = 4, limit: int = 600) -> str:
    """The end of an error (a traceback's last lines name the exception), at most ``limit`` characters."""
    return " | ".join(text.strip().splitlines()[-n:])[-limit:]


def engine_params(
    n: int, p: int, s: int, gen: int, threads: int, **context: Any
) -> tuple[ContextParams, GenerationParams]:
    """An in-process engine cell's context and generation parameters: N agents over a ``p``-token prefix,
    suffixes of ``s`` tokens at most (plus a margin of 2), ``gen`` tokens each with
    EOS ignored, on ``threads`` threads; ``context``: other :class:`~polykv_py.llama.ContextParams` fields."""
    from polykv_py.engine import GenerationParams, SharedPrefixEngine

    params = SharedPrefixEngine.context_params(n, p, s + 2, gen)
    params = dataclasses.replace(params, n_threads=threads, n_threads_batch=threads, **context)
    return params, GenerationParams(max_tokens=gen, ignore_eos=True)


def _engine_child(job: Json) -> Json:
    import resource

    from polykv_py.engine import SharedPrefixEngine
    from polykv_py.llama import Model

    n, gen = job["n"], job["gen"]
    with Model(job["model"]) as model:
        t_load = time.perf_counter()
        vocab = model.vocab
        p_tok = len(vocab.tokenize(job["base"]))
        s_tok = max(len(vocab.tokenize(job["base"] + s)) for sfx in job["suffixes"] for s in sfx) - p_tok
        params, gp = engine_params(n, p_tok, s_tok, gen, job["threads"])
        rounds = []
        with SharedPrefixEngine(model, params) as eng:
            for r in range(job["rounds"]):
                res = eng.run(job["base"], job["suffixes"][r], gp, share=True, measure_kv=True)
                ft = [a.timings.first_token_s for a in res.agents]
                prompt = (0 if res.prefix_reused else len(res.prefix_tokens)) + sum(
                    len(a.suffix_tokens) for a in res.agents
                )
                rounds.append(
                    {
                        "wall_s": round(res.timings["wall_s"], 3),
                        "prime_s": round(res.timings["prefix_s"], 3),
                        "ttft_mean_s": round(mean(ft), 3),
                        "ttft_p50_s": round(median(ft), 3),
                        "ttft_max_s": round(max(ft), 3),
                        "ttft_from": "run start (prefix decode included)",
                        "prompt_tokens_processed": prompt,
                        "prompt_tokens_metrics": res.tokens_processed,
                        "prefix_tokens": len(res.prefix_tokens),
                        "pool_tokens": len(res.prefix_tokens),
                        "mean_prompt_tokens": round(mean(len(a.prompt_tokens) for a in res.agents), 1),
                        "generated": sum(len(a.tokens) for a in res.agents),
                        "kv_cells_peak": max((res.kv_cells or {}).values(), default=None),
                        "rss_peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                        "statuses": {f"{res.mode}{' (prefix reused)' if res.prefix_reused else ''}": n},
                        "errors": [],
                        "n_errors": 0,
                        "kv_evictions": 0,
                    }
                )
        log.debug("engine cell done in %.1fs", time.perf_counter() - t_load)
    return {"system": "engine", "n": n, "p": job["p"], "ctx": params.n_ctx, "server_args": [], "rounds": rounds}


# --------------------------------------------------------------------------- capacity
def capacity_probe(system: str, cfg: BenchConfig, deadline: float) -> Json:
    """Largest N that runs concurrently at ``-c capacity_ctx`` with P = ``capacity_p``.

    One server with a slot per agent (plus one); each step empties the agent slots, runs
    N agents at once and checks: no error, every agent generated G tokens, no eviction
    or full-KV line in the log, and (patched) every share a hit. It tries the predicted
    maximum and one agent more, so a report says what happens past the prediction.
    """
    c_cells, p = cfg.capacity_ctx, cfg.capacity_p
    share = SERVER_SYSTEMS[system].pool
    per_agent = p + cfg.suffix + cfg.gen
    predicted = (c_cells - p) // (cfg.suffix + cfg.gen) if share else c_cells // per_agent
    predicted = max(1, min(predicted, cfg.capacity_max))
    candidates = list(cfg.capacity_n.get(system) or [predicted, predicted + 1])
    slots = max(candidates) + 1
    steps: list[Json] = []
    out: dict[str, Any] = {
        "system": system,
        "ctx": c_cells,
        "p": p,
        "slots": slots,
        "predicted": predicted,
        "candidates": candidates,
        "steps": steps,
    }
    server = start_server(system, slots, c_cells, cfg)
    try:
        base, suffixes = make_inputs(server, p, max(candidates), cfg.suffix)
        params = {"n_predict": cfg.gen, "ignore_eos": True, "temperature": 0.0}
        agents = [Agent(sfx, name=f"a{i}", mode="completion", params=params) for i, sfx in enumerate(suffixes[0])]

        async def go() -> None:
            async with AsyncClient(
                server.url, server=server, timeout=cfg.capacity_timeout + 60, max_connections=slots + 8
            ) as client:  # every agent in flight at once
                sc = Fanout(client, BasePrompt.from_text(base), share=SERVER_SYSTEMS[system].share)
                kv = KVCellsLog(server.log_path)
                if share:
                    await sc.prime()
                for n in candidates:
                    if time.monotonic() > deadline:
                        steps.append({"n": n, "fits": None, "note": "not run: time budget spent"})
                        continue
                    for slot in range(slots):
                        if not (share and slot == sc.pool_slot):
                            await client.erase_slot(slot)
                    kv.mark()
                    sc.concurrency = n
                    t0 = time.perf_counter()
                    try:
                        res = await asyncio.wait_for(
                            sc.run(agents[:n], prime=False), max(1.0, deadline - time.monotonic())
                        )
                    except TimeoutError:
                        steps.append({"n": n, "fits": None, "note": "timed out (time budget)"})
                        return
                    await asyncio.sleep(0.3)
                    reading = kv.read()
                    bad = [a for a in res.agents if a.error or a.n_generated < cfg.gen or (share and a.status != "hit")]
                    fits = not bad and reading.evictions == 0 and reading.peak <= c_cells
                    steps.append(
                        {
                            "n": n,
                            "fits": fits,
                            "wall_s": round(time.perf_counter() - t0, 2),
                            "kv_cells_peak": reading.peak,
                            "kv_evictions": reading.evictions,
                            "statuses": res.statuses,
                            "n_bad": len(bad),
                            "errors": [a.error for a in bad if a.error][:2],
                        }
                    )

        asyncio.run(go())
    except PolykvError as exc:
        out["error"] = str(exc)
    finally:
        server.stop()
    fitting = [s["n"] for s in steps if s.get("fits")]
    failing = [s["n"] for s in steps if s.get("fits") is False]
    out["largest_fitting"] = max(fitting) if fitting else None
    out["smallest_failing"] = min(failing) if failing else None
    return out


# --------------------------------------------------------------------------- driver
class Bench:
    """Runs the grid, keeps the results and writes them after every cell."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.cells: list[Json] = []
        self.capacity: list[Json] = []
        self.notes: list[str] = []
        self.doc: dict[str, Any] = {}
        self.t0 = time.perf_counter()

    def say(self, msg: str) -> None:
        sys.stderr.write(f"[{time.perf_counter() - self.t0:8.1f}s] {msg}\n")
        sys.stderr.flush()

    def run(self) -> Json:
        cfg = self.cfg
        from polykv_py.models import resolve_model
        from polykv_py.native import server_binary

        model = resolve_model(cfg.model)
        self.doc = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
            "machine": machine_info(cfg.threads),
            "model": str(model),
            "binaries": {k: str(server_binary(k)) for k in ("patched", "upstream")},
            "kv_cells_method": KV_METHOD,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        if cfg.capacity_only:
            return self._capacity_only()
        grid = [(n, p, s) for p in cfg.ps for n in cfg.ns for s in cfg.systems]
        engine_inputs: dict[tuple[int, int], tuple[str, list[list[str]]]] = {}
        engine_ok = "engine" in cfg.systems
        for k, (n, p, system) in enumerate(grid, 1):
            label = f"[{k}/{len(grid)}] {system} N={n} P={p}"
            if system == "engine":
                if not engine_ok:
                    continue
                if (n, p) not in engine_inputs:
                    self.say(f"{label}: skipped (no server cell produced its inputs)")
                    continue
                self.say(f"{label} ...")
                try:
                    cell = run_engine_cell(n, p, cfg, *engine_inputs[(n, p)])
                except (PolykvError, subprocess.TimeoutExpired, ValueError) as exc:
                    engine_ok = False
                    note = f"engine skipped from N={n} P={p} on: {_last_lines(str(exc))}"
                    self.notes.append(note)
                    self.say(note)
                    continue
            else:
                self.say(f"{label} ...")
                try:
                    cell = run_server_cell(system, n, p, cfg)
                except (PolykvError, TimeoutError) as exc:
                    cell = {"system": system, "n": n, "p": p, "error": str(exc)[:800], "rounds": []}
                inputs = cell.pop("_inputs", None)
                if inputs is not None:
                    engine_inputs.setdefault((n, p), inputs)
            self.cells.append(cell)
            rounds = cell.get("rounds") or []
            if rounds:
                r1 = rounds[0]
                r2 = f", round 2 {rounds[1]['wall_s']:.1f}s" if len(rounds) > 1 else ""
                self.say(
                    f"{label}: {r1['wall_s']:.1f}s, {r1['prompt_tokens_processed']} prompt tokens, "
                    f"KV peak {r1['kv_cells_peak']}{r2}"
                )
            else:
                self.say(f"{label}: error {cell.get('error', '')[:200]}")
            self.write()
        if cfg.capacity:
            self._capacity()
        self.doc["machine"]["load_avg_end"] = load_avg()
        self.doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        self.write(final=True)
        return self.doc

    def _capacity(self) -> None:
        cfg = self.cfg
        for system in [s for s in CAPACITY_SYSTEMS if s in cfg.systems]:
            self.say(f"capacity probe {system}: -c {cfg.capacity_ctx}, P={cfg.capacity_p} ...")
            res = capacity_probe(system, cfg, time.monotonic() + cfg.capacity_timeout)
            self.capacity.append(res)
            self.say(
                f"capacity {system}: largest fitting N = {res.get('largest_fitting')}, "
                f"smallest failing = {res.get('smallest_failing')} (predicted {res.get('predicted')})"
            )
            self.write()

    def _capacity_only(self) -> Json:
        """Run only the capacity probe, keeping the grid cells of an earlier run in the same folder."""
        old = self.cfg.out_dir / "fanout.json"
        if old.is_file():
            prev = json.loads(old.read_text())
            self.cells, self.notes = prev.get("cells", []), prev.get("notes", [])
            rerun = {s for s in CAPACITY_SYSTEMS if s in self.cfg.systems}
            self.capacity = [c for c in prev.get("capacity", []) if c.get("system") not in rerun]
            for key in ("config", "machine", "started"):
                if key in prev:
                    self.doc[key] = prev[key]
            self.doc["config"]["capacity_timeout"] = self.cfg.capacity_timeout
            self.doc["config"]["capacity_n"] = self.cfg.capacity_n
            self.notes.append(
                f"capacity probe run separately ({time.strftime('%Y-%m-%d %H:%M:%S')}, load average {load_avg()})"
            )
        self._capacity()
        self.doc["machine"]["load_avg_end"] = load_avg()
        self.doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        self.write(final=True)
        return self.doc

    def write(self, final: bool = False) -> None:
        from . import fanout_report

        out = self.cfg.out_dir
        out.mkdir(parents=True, exist_ok=True)
        self.doc.update({"cells": self.cells, "capacity": self.capacity, "notes": self.notes})
        (out / "fanout.json").write_text(json.dumps(self.doc, indent=2))
        (out / "fanout.md").write_text(fanout_report.markdown(self.doc))
        if final:
            png = fanout_report.plot(self.doc, out / "fanout.png")
            if png is None:
                self.notes.append("no PNG: matplotlib is not installed (pip install 'polykv[bench]')")
                (out / "fanout.md").write_text(fanout_report.markdown(self.doc))
                (out / "fanout.json").write_text(json.dumps(self.doc, indent=2))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    ap.add_argument("--quick", action="store_true", help="N in {1,2,4,8}, P=2048, short capacity probe")
    ap.add_argument("--n", type=int, nargs="+", help="agent counts (default 1 2 4 8 16)")
    ap.add_argument("--p", type=int, nargs="+", help="base context tokens (default 512 2048 4096)")
    ap.add_argument("--suffix", type=int, default=64, help="suffix tokens per agent (default 64)")
    ap.add_argument("--gen", type=int, default=32, help="generated tokens per agent (default 32)")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, help="systems to run (default all)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per cell (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per server/engine (default 2)")
    ap.add_argument("--no-capacity", action="store_true", help="skip the capacity probe")
    ap.add_argument("--capacity-timeout", type=float, help="seconds per system for the capacity probe")
    ap.add_argument("--capacity-max", type=int, default=128, help="largest N the capacity probe tries (default 128)")
    ap.add_argument("--capacity-patched", type=int, nargs="+", help="N the capacity probe tries on the patched server")
    ap.add_argument("--capacity-stock", type=int, nargs="+", help="N the capacity probe tries on the stock server")
    ap.add_argument(
        "--capacity-only",
        action="store_true",
        help="run only the capacity probe (keeps the grid of fanout.json in --out)",
    )
    ap.add_argument("--model", "-m", help="GGUF path (default: the default model)")
    ap.add_argument(
        "--server-args",
        default="",
        metavar="ARGS",
        help="arguments every server gets, stock and patched alike, split as a shell would (e.g. '-ngl 99')",
    )
    ap.add_argument("--out", default=str(RESULTS), help="output folder (default: bench/results of this checkout)")
    ap.add_argument(
        "--restart",
        action="store_true",
        help="the restart scenario instead (bench/restart.py: a saved pool restored after a restart vs the stock "
        "server cold and restoring its own slot files; --n, --p, --threads, --model; writes OUT/restart)",
    )
    ap.add_argument("--engine-cell", help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    cfg = BenchConfig(
        suffix=args.suffix,
        gen=args.gen,
        rounds=args.rounds,
        threads=args.threads,
        capacity=not args.no_capacity,
        capacity_max=args.capacity_max,
        out_dir=Path(args.out),
        model=args.model,
        quick=args.quick,
        server_args=tuple(shlex.split(args.server_args)),
    )
    if args.quick:
        cfg.ns, cfg.ps, cfg.capacity_timeout = [8, 4, 2, 1], [2048], 420.0  # the target cell (N=8) first
        cfg.capacity_n = {"patched": [100], "stock_kvu": [3, 4]}
    cfg.ns = args.n or cfg.ns
    cfg.ps = args.p or cfg.ps
    cfg.systems = args.systems or cfg.systems
    if args.capacity_timeout:
        cfg.capacity_timeout = args.capacity_timeout
    if args.capacity_patched:
        cfg.capacity_n["patched"] = args.capacity_patched
    if args.capacity_stock:
        cfg.capacity_n["stock_kvu"] = args.capacity_stock
    cfg.capacity_only = args.capacity_only
    if cfg.capacity_only:
        cfg.capacity = True
    return cfg


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark (or the restart scenario, or internally one engine cell) for parsed arguments."""
    if args.engine_cell:
        job = json.loads(sys.stdin.read() if args.engine_cell == "-" else args.engine_cell)
        sys.stdout.write(json.dumps(_engine_child(job)) + "\n")  # the cell's result, read by the parent
        return 0
    if args.restart:
        from . import restart

        rcfg = restart.RestartConfig(threads=args.threads, model=args.model, out_dir=Path(args.out) / "restart")
        rcfg.ns, rcfg.ps = args.n or rcfg.ns, args.p or rcfg.ps
        restart.run(rcfg)
        return 0
    cfg = config_from_args(args)
    bench = Bench(cfg)
    bench.run()
    bench.say(
        f"wrote {cfg.out_dir}/fanout.json, fanout.md"
        + (", fanout.png" if (cfg.out_dir / "fanout.png").exists() else "")
    )
    return 0


def build_parser(prog: str = "python -m bench.fanout") -> argparse.ArgumentParser:
    """The benchmark's command line (``prog``: how the help names it, e.g. ``polykv bench``)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return ap


def parse_args(argv: Sequence[str] | None) -> BenchConfig | None:
    """The configuration for command-line arguments (None for an internal engine cell)."""
    args = build_parser().parse_args(argv)
    return None if args.engine_cell else config_from_args(args)


def main(argv: Sequence[str] | None = None, prog: str = "python -m bench.fanout") -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_from_args(build_parser(prog).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

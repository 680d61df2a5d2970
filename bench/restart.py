"""A fan-out right after a server restart: the base restored from a file, or computed again.

For each P a base of about P tokens is computed once and saved: by the patched server as a
pool file (patch 0075, ``/slots/0?action=save``) and by the stock server with its own slot
save (``llama_state_seq_save_file``). Then for each N a fresh server (the restart) runs N
agents over that base, each agent an S-token suffix and G greedy tokens, in these systems:

- ``stock_cold``: the stock server with its defaults (a KV stream per slot), nothing saved:
  every agent computes the base;
- ``stock_queued_cold``: the stock server at the sharing KV budget, the base sent once and
  reused from its slot cache, the agents queued (the best stock system of the one-turn grid);
- ``stock_restore``: the stock server given its own best file-based option: the saved base
  restored into every agent's slot (N restores, N copies in memory), each agent pinned to
  its slot, idle-slot caching off (with it on the restored slots are cleared before use);
- ``patched_prime``: polykv with a fresh priming (no file);
- ``patched_restore``: polykv with the pool restored from its file (:class:`~polykv_py.pools.PoolCache`).

Per cell: the wall time from the first request after the restart to the last answer
(restores and priming included; server start-up is not), the restore time the server
reports, prompt tokens the server computed, whether the stock restores were used (each
agent's ``cache_n`` covers the base), and peak KV cells. The files are read from a warm
page cache (they were just written). Writes ``restart.json`` and ``restart.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polykv_py.client import AsyncClient, Request
from polykv_py.fanout import Agent, BasePrompt, Fanout
from polykv_py.harness.kvcells import KV_METHOD, KVCellsLog
from polykv_py.harness.report import table
from polykv_py.jsontypes import Json
from polykv_py.pools import PoolCache

from . import RESULTS
from .common import PeakRSS, machine_info, make_inputs, round_summary, system_budget
from .systems import SYSTEMS as SERVER_SYSTEMS
from .systems import System, start_system_server

log = logging.getLogger(__name__)


_STOCK_RESTORE = System(
    "stock_restore", SERVER_SYSTEMS["stock"].kind, ("--no-cache-idle-slots", "--cache-ram", "0"), False, False,
    "copies",
    "stock, saved base restored into every agent's slot",
)  # fmt: skip
#: Each restart system: (server recipe, how the base gets into the server).
RESTART_SYSTEMS: dict[str, tuple[System, str]] = {
    "stock_cold": (SERVER_SYSTEMS["stock"], "cold"),
    "stock_queued_cold": (SERVER_SYSTEMS["stock_queued"], "prime"),
    "stock_restore": (_STOCK_RESTORE, "slot_restore"),
    "patched_prime": (SERVER_SYSTEMS["patched"], "prime"),
    "patched_restore": (SERVER_SYSTEMS["patched"], "pool_restore"),
}
STOCK_FILE = "stock-base.bin"


@dataclass
class RestartConfig:
    ns: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    ps: list[int] = field(default_factory=lambda: [512, 2048, 4096])
    suffix: int = 64
    gen: int = 32
    threads: int = 2
    systems: list[str] = field(default_factory=lambda: list(RESTART_SYSTEMS))
    model: str | None = None
    out_dir: Path = RESULTS / "restart"
    timeout: float = 3600.0


def budget(system: str, n: int, p: int, cfg: RestartConfig) -> tuple[int, int, int]:
    """(KV cells, slots, agents in flight) as in the one-turn grid; the stock restore needs N copies and N slots."""
    spec, how = RESTART_SYSTEMS[system]
    cells, slots, in_flight = system_budget(spec, n, p, cfg.suffix, cfg.gen)
    if how == "slot_restore":  # every agent pinned to the slot its copy was restored into: no spare slot
        slots = n
    return cells, slots, in_flight


def save_base(p: int, cfg: RestartConfig, save_dir: Path) -> tuple[str, list[str], Json]:
    """The process before the restart: the patched server computes the base once and saves its pool file.
    Returns the base, the agents' suffixes and the save's answer."""
    spec = RESTART_SYSTEMS["patched_restore"][0]
    cells, slots, _ = budget("patched_restore", 1, p, cfg)
    server = start_system_server(spec, slots, cells, model=cfg.model, threads=cfg.threads, name="save-pool",
                                 save_path=f"{save_dir}/")  # fmt: skip
    try:
        base, rounds = make_inputs(server, p, max(cfg.ns), cfg.suffix)
        c = server.client
        tokens = c.prompt_tokens(base)
        name = _pool_name(c, tokens)
        c.prime(tokens, 0)
        info = {"pool_save": c.save_pool(0, name), "pool_file_bytes": (save_dir / name).stat().st_size}
    finally:
        server.stop()
    return base, rounds[0], info


def _pool_name(c: Any, tokens: list[int]) -> str:
    from polykv_py.pools import pool_file_name

    identity = c.pool_features().pool_files
    assert identity is not None, "the patched server reports no pool files (patch 0075)"
    return pool_file_name(identity, tokens)


def save_stock_slot(spec: System, slots: int, cells: int, base: str, cfg: RestartConfig, save_dir: Path) -> Json:
    """The stock server's own save of the base (slot 0), from a server with the cell's slots and KV: upstream's
    file records the KV stream count, and a restore into another layout fails (``n_stream mismatch``)."""
    server = start_system_server(spec, slots, cells, model=cfg.model, threads=cfg.threads, name="save-stock",
                                 save_path=f"{save_dir}/")  # fmt: skip
    try:
        c = server.client
        c.prime(base, 0)
        return dict(c.send(Request.post("/slots/0?action=save", {"filename": STOCK_FILE})))
    finally:
        server.stop()


def run_cell(system: str, n: int, p: int, base: str, suffixes: list[str], cfg: RestartConfig, save_dir: Path) -> Json:
    """One fan-out on a fresh server (the restart)."""
    spec, how = RESTART_SYSTEMS[system]
    cells, slots, concurrency = budget(system, n, p, cfg)
    saved = save_stock_slot(spec, slots, cells, base, cfg, save_dir) if how == "slot_restore" else None
    server = start_system_server(spec, slots, cells, model=cfg.model, threads=cfg.threads, name=f"restart-{system}",
                                 save_path=f"{save_dir}/")  # fmt: skip
    params = {"n_predict": cfg.gen, "ignore_eos": True, "temperature": 0.0}
    try:

        async def go() -> Json:
            async with AsyncClient(server.url, server=server, timeout=cfg.timeout) as client:
                kv = KVCellsLog(server.log_path)
                kv.mark()
                restore_ms: list[float] = []
                t0 = time.perf_counter()
                pool_cache = PoolCache(save_dir) if how == "pool_restore" else None
                sc = Fanout(client, BasePrompt.from_text(base), share=spec.share, concurrency=concurrency,
                                   pool_cache=pool_cache)  # fmt: skip
                agents = [Agent(s, name=f"a{i}", mode="completion", params=params) for i, s in enumerate(suffixes[:n])]
                if how == "slot_restore":  # N restores, then each agent on its own restored slot
                    for i in range(n):
                        r = await client.send(Request.post(f"/slots/{i}?action=restore", {"filename": STOCK_FILE}))
                        restore_ms.append(float(r["timings"]["restore_ms"]))
                    agents = [
                        Agent(a.instructions, a.name, a.mode, {**a.params, "id_slot": i}) for i, a in enumerate(agents)
                    ]
                with PeakRSS(server) as rss:
                    res = await sc.run(agents, prime=how in ("prime", "pool_restore"))
                wall = time.perf_counter() - t0
                await asyncio.sleep(0.3)
                out = round_summary(res, kv.read().peak, rss.peak, {})
                out["wall_s"] = round(wall, 3)  # restores included
                out.pop("prompt_tokens_metrics")
                restore_ms += [p.restore_ms for p in res.primes if p.restore_ms is not None]
                out["restored"] = bool(restore_ms)
                out["restore_ms"] = round(sum(restore_ms), 1) if restore_ms else None
                out["restores"] = len(restore_ms)
                pool_n = res.pool_tokens or len(await sc.pool_tokens())
                out["agents_reusing_base"] = sum(a.cached >= pool_n - 1 for a in res.agents)
                return out

        cell = asyncio.run(asyncio.wait_for(go(), cfg.timeout))
        if saved is not None:
            cell["stock_file_bytes"] = saved.get("n_written")
        return {"system": system, "n": n, "p": p, "ctx": cells, "slots": slots, "server_args": server.args, **cell}
    finally:
        server.stop()


def markdown(doc: Json) -> str:
    """The report: one row per cell, the ratios against stock cold and stock restore."""
    lines = [
        "# Fan-out after a server restart",
        "",
        f"Machine: {doc['machine']['cpu']}, {doc['machine']['logical_cpus']} logical CPUs, load average at the start "
        f"{doc['machine']['load_avg_start']}; {doc['config']['threads']} threads per server; "
        f"S={doc['config']['suffix']}, "
        f"G={doc['config']['gen']}. Wall: first request after the restart to the last answer (restores and priming "
        "included). KV cells from the server's debug log.",
        "",
    ]
    by = {(c["p"], c["n"], c["system"]): c for c in doc["cells"]}
    rows = []
    for p in doc["config"]["ps"]:
        for n in doc["config"]["ns"]:
            mine = by.get((p, n, "patched_restore"))
            for system in doc["config"]["systems"]:
                c = by.get((p, n, system))
                if c is None:
                    continue
                ratio = (
                    f"{c['wall_s'] / mine['wall_s']:.2f}x"
                    if mine and system != "patched_restore" and mine["wall_s"]
                    else ""
                )
                rows.append([p, n, system, f"{c['wall_s']:.2f}", ratio, c.get("restore_ms") or "",
                             c["prompt_tokens_processed"], c.get("kv_cells_peak") or "",
                             f"{c['agents_reusing_base']}/{n}"])  # fmt: skip
    lines.append(table(["P", "N", "system", "wall s", "vs patched_restore", "restore ms", "prompt tokens computed",
                        "KV cells peak", "agents reusing the base"], rows, markdown=True))  # fmt: skip
    lines += ["", f"Files: {json.dumps(doc.get('files', {}))}", ""]
    return "\n".join(lines)


def run(cfg: RestartConfig) -> Json:
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    doc: Json = {
        "config": {**cfg.__dict__, "out_dir": str(cfg.out_dir)},
        "machine": machine_info(cfg.threads),
        "kv_cells_method": KV_METHOD,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cells": [],
        "files": {},
    }
    t0 = time.perf_counter()
    for p in cfg.ps:
        save_dir = cfg.out_dir / f"files-p{p}"
        save_dir.mkdir(exist_ok=True)
        base, suffixes, info = save_base(p, cfg, save_dir)
        doc["files"][str(p)] = {"pool_file_bytes": info["pool_file_bytes"],
                                "pool_save_ms": info["pool_save"]["timings"]["save_ms"]}  # fmt: skip
        for n in cfg.ns:
            for system in cfg.systems:
                sys.stderr.write(f"[{time.perf_counter() - t0:8.1f}s] {system} N={n} P={p} ...\n")
                cell = run_cell(system, n, p, base, suffixes, cfg, save_dir)
                sys.stderr.write(f"[{time.perf_counter() - t0:8.1f}s]   {cell['wall_s']:.2f}s, restore "
                                 f"{cell['restore_ms']} ms, {cell['prompt_tokens_processed']} prompt tokens"
                                 "\n")  # fmt: skip
                doc["cells"].append(cell)
                _write(doc, cfg.out_dir)
        shutil.rmtree(save_dir)  # the saved states: tens of MB each, not part of the report
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    _write(doc, cfg.out_dir)
    return doc


def _write(doc: Json, out: Path) -> None:
    (out / "restart.json").write_text(json.dumps(doc, indent=2))
    (out / "restart.md").write_text(markdown(doc))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--p", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--systems", nargs="+", choices=list(RESTART_SYSTEMS), default=list(RESTART_SYSTEMS))
    ap.add_argument("--suffix", type=int, default=64, help="tokens of each agent's own suffix (default 64)")
    ap.add_argument("--gen", type=int, default=32, help="greedy tokens per agent (default 32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", "-m")
    ap.add_argument("--out", type=Path, default=RESULTS / "restart")
    args = ap.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = RestartConfig(ns=args.n, ps=args.p, suffix=args.suffix, gen=args.gen, systems=args.systems,
                        threads=args.threads, model=args.model, out_dir=args.out)  # fmt: skip
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())

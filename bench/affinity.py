"""What routing buys in work: M bases x N agents over K replicas behind smg, per routing policy.

On one 2-core machine replicas only compete for the cores, so this benchmark counts *work*,
not speed: prompt tokens the replicas computed (their ``llamacpp:prompt_tokens_total``, priming
included) and KV cells (the sum over replicas of each one's peak), plus where requests landed
and how they were served. Systems, each on a fresh cluster of the same shape:

- ``affinity``: ``--policy manual``, every request carries its pool's routing key
  (:class:`~polykv_py.routing.RoutedFanout`): each base primed once, on one replica, shared there;
- ``round_robin`` / ``cache_aware``: plain OpenAI requests, no key, nothing primed: what a stock
  server behind the gateway gets (``cache_aware`` routes by the prompt's text prefix);
- ``round_robin_pools`` / ``cache_aware_pools``: the drop-in way without a key: every base primed
  as a pool on every replica (``--pool-auto`` shares it with any plain request that lands there).

``python -m bench.affinity`` writes ``affinity.json`` and ``affinity.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from polykv_py.client import OAI_COMPLETION, AsyncClient, Request, routed_replica
from polykv_py.cluster import Cluster, ClusterConfig
from polykv_py.fanout import Agent, BasePrompt
from polykv_py.gateway import GatewayOptions
from polykv_py.harness.kvcells import KV_METHOD, KVCellsLog
from polykv_py.pools import PoolCache

from . import RESULTS
from .machine import cpu_model, load_avg

log = logging.getLogger(__name__)

SYSTEMS = ("affinity", "round_robin", "cache_aware", "round_robin_pools", "cache_aware_pools")
CITIES = ("Arden", "Brisk", "Corvale", "Dunmore", "Elster", "Fenwick", "Garrow", "Hollin")


@dataclass(frozen=True)
class AffinityConfig:
    """M bases, N agents per base, K replicas; base length in records (~22 tokens each)."""

    bases: int = 3
    agents: int = 4
    replicas: int = 3
    records: int = 40
    gen: int = 16
    agent_slots: int = 4
    ctx: int = 16384
    threads: int = 1
    model: str | None = None


def base_texts(cfg: AffinityConfig) -> list[str]:
    cities = (CITIES * (cfg.bases // len(CITIES) + 1))[: cfg.bases]
    line = "Record {i}: in {city}, warehouse {i} holds {n} crates of tin."
    return [
        "\n".join(line.format(i=i, city=city, n=(i * 7 + k * 13) % 97) for i in range(cfg.records))
        for k, city in enumerate(cities)
    ]


def questions(cfg: AffinityConfig) -> list[str]:
    return [
        f"\nQuestion: how many crates does warehouse {(5 + 11 * j) % cfg.records} hold? Answer:"
        for j in range(cfg.agents)
    ]


def cluster_config(system: str, cfg: AffinityConfig) -> ClusterConfig:
    policy = "manual" if system == "affinity" else system.removesuffix("_pools")
    return ClusterConfig(
        replicas=cfg.replicas,
        pools_per_replica=max(cfg.bases, 1),
        agent_slots=cfg.agent_slots,
        ctx=cfg.ctx,
        threads=cfg.threads,
        model=cfg.model,
        track_kv=True,
        gateway=replace(GatewayOptions(), policy=policy),  # type: ignore[arg-type]
    )


async def _plain(gw: AsyncClient, model: str, prompt: str, gen: int) -> tuple[str | None, str]:
    """One plain OpenAI completion through the gateway: (replica, share status or 'plain')."""
    body = {"model": model, "prompt": prompt, "max_tokens": gen, "temperature": 0.0}
    headers, doc = await gw.send(Request("POST", OAI_COMPLETION, body, parse=lambda r: (r.headers, r.json())))
    sp = doc.get("shared_prefix")
    return routed_replica(headers), str(sp.get("status")) if isinstance(sp, dict) else "plain"


async def _run_system(system: str, cluster: Cluster, cfg: AffinityConfig) -> tuple[list[str | None], list[str]]:
    bases, qs = base_texts(cfg), questions(cfg)
    model = cluster.config.alias
    if system == "affinity":
        async with cluster.router() as router:
            ctxs = [
                router.context(BasePrompt.from_text(b), concurrency=cfg.agents, pool_cache=cluster.pool_cache)
                for b in bases
            ]
            agents = [Agent(q, params={"n_predict": cfg.gen, "temperature": 0.0}) for q in qs]
            results = await asyncio.gather(*(c.run(agents) for c in ctxs))
        return [a.replica for r in results for a in r.agents], [a.status for r in results for a in r.agents]
    if system.endswith("_pools"):  # the drop-in way without a key: every base a pool on every replica
        for r in cluster.replicas:
            for slot, b in enumerate(bases):
                await asyncio.to_thread(r.client.prime, b, slot)
    async with AsyncClient(cluster.url) as gw:
        out = await asyncio.gather(*(_plain(gw, model, b + q, cfg.gen) for b in bases for q in qs))
    return [r for r, _ in out], [s for _, s in out]


def run_system(system: str, cfg: AffinityConfig, log_dir: Path) -> dict[str, Any]:
    """One system on a fresh cluster: work summed over the replicas."""
    cache = PoolCache(log_dir / f"pools-{system}")
    with Cluster(cluster_config(system, cfg), pool_cache=cache, log_dir=log_dir) as cluster:
        kvs = [KVCellsLog(r.log_path) for r in cluster.replicas]
        for kv in kvs:
            kv.mark()
        before = [r.client.metrics().get("llamacpp:prompt_tokens_total", 0.0) for r in cluster.replicas]
        t0 = time.perf_counter()
        replicas, statuses = asyncio.run(_run_system(system, cluster, cfg))
        wall = time.perf_counter() - t0
        time.sleep(0.3)  # the servers' last log lines
        after = [r.client.metrics().get("llamacpp:prompt_tokens_total", 0.0) for r in cluster.replicas]
        peaks = [kv.read().peak or 0 for kv in kvs]
        names = {r.url: f"r{i}" for i, r in enumerate(cluster.replicas)}
    bases = base_texts(cfg)
    per_base = [
        sorted({names.get(str(x), "?") for x in replicas[k * cfg.agents : (k + 1) * cfg.agents]})
        for k in range(len(bases))
    ]
    return {
        "system": system,
        "prompt_tokens_processed": int(sum(a - b for a, b in zip(after, before, strict=True))),
        "kv_cells_peak_sum": sum(peaks),
        "kv_cells_peak_per_replica": peaks,
        "requests_per_replica": dict(Counter(names.get(str(x), "?") for x in replicas)),
        "replicas_per_base": per_base,
        "statuses": dict(Counter(statuses)),
        "wall_s": round(wall, 2),
    }


def markdown(doc: dict[str, Any]) -> str:
    from polykv_py.harness.report import ratio, table

    cfg = doc["config"]
    cells = {c["system"]: c for c in doc["cells"]}
    aff = cells.get("affinity")
    rows = []
    for name, c in cells.items():
        rows.append([
            name, c["prompt_tokens_processed"],
            ratio(c["prompt_tokens_processed"], aff["prompt_tokens_processed"]) if aff else None,
            c["kv_cells_peak_sum"], ratio(c["kv_cells_peak_sum"], aff["kv_cells_peak_sum"]) if aff else None,
            " ".join(f"{k}:{v}" for k, v in sorted(c["requests_per_replica"].items())),
            " ".join("/".join(b) for b in c["replicas_per_base"]),
            ", ".join(f"{k} {v}" for k, v in sorted(c["statuses"].items())),
        ])  # fmt: skip
    headers = ["system", "prompt tokens computed", "x affinity", "KV cells (sum of peaks)", "x affinity",
               "requests per replica", "replicas per base", "statuses"]  # fmt: skip
    return "\n".join([
        "# Routing: what pool affinity saves across replicas",
        "",
        f"{cfg['bases']} bases (~{doc['base_tokens']} tokens each) x {cfg['agents']} agents over {cfg['replicas']} "
        f"replicas behind smg {doc['smg_version']}; {cfg['gen']} greedy tokens per agent. Work summed over the "
        "replicas, priming included; KV cells: each replica's peak (" + KV_METHOD + "), summed.",
        f"Machine: {doc['machine']['cpu']}, load average at start {doc['machine']['load_avg_start']}. "
        "Counts, not times: on one machine the replicas share the cores.",
        "",
        table(headers, rows, markdown=True),
        "",
    ]) + "\n"  # fmt: skip


def run(cfg: AffinityConfig, systems: Sequence[str], out_dir: Path) -> dict[str, Any]:
    from importlib.metadata import version

    out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "config": cfg.__dict__,
        "smg_version": version("smg"),
        "base_tokens": None,
        "machine": {"cpu": cpu_model(), "load_avg_start": load_avg()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cells": [],
    }
    for system in systems:
        log.info("affinity: %s ...", system)
        cell = run_system(system, cfg, Path(tempfile.mkdtemp(prefix=f"polykv-affinity-{system}-")))
        doc["cells"].append(cell)
        log.info("affinity: %s: %s", system, cell)
    from polykv_py.presets import serve_server

    with serve_server(1, agent_slots=1, ctx=2048, threads=1, name="tokenizer") as srv:
        doc["base_tokens"] = len(srv.client.prompt_tokens(base_texts(cfg)[0]))
    doc["machine"]["load_avg_end"] = load_avg()
    (out_dir / "affinity.json").write_text(json.dumps(doc, indent=2))
    (out_dir / "affinity.md").write_text(markdown(doc))
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.affinity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bases", type=int, default=3)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--out", type=Path, default=RESULTS / "affinity")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run(AffinityConfig(bases=args.bases, agents=args.agents, replicas=args.replicas), args.systems, args.out)
    sys.stdout.write((args.out / "affinity.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

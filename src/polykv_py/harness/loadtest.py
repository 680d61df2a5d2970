"""Load test: many agents in rounds over one reserved pool, checked against a serial reference.

One patched server (unified KV, ``--pool-slots 0``, ``n_slots`` agent slots) holds a
``pool_tokens``-token base.  Each agent's answer is first computed alone (the serial
reference); then ``rounds`` times all ``n_agents`` ask again, at most ``n_slots`` in
flight, each request bounded in time.  Every round checks:

- no request failed, the server is alive, no request recomputed its P-token prefix
  (status ``hit``, or ``own_cache`` when its slot still held the shared cells from an
  earlier agent of the round);
- every answer equals its serial reference: identical, or diverging only at a near
  tie (see :mod:`polykv_py.harness.compare`; concurrent requests sit in other KV cells and the
  CPU attention kernels round by cell order);
- no KV leak: after erasing the agent slots, the cells in use are exactly the pool's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from ..client import AsyncClient, Share
from ..server import LlamaServer
from .compare import compare_greedy
from .kvcells import KVCellsLog

log = logging.getLogger(__name__)

POOL = 0


@dataclass(frozen=True)
class LoadConfig:
    n_slots: int = 16
    pool_tokens: int = 2048
    n_agents: int = 64
    rounds: int = 10
    suffix_tokens: int = 64
    n_predict: int = 16
    request_timeout: float = 300.0
    threads: int | None = None
    model: str | None = None


@dataclass
class RoundResult:
    round: int
    wall_s: float
    errors: list[str] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    identical: int = 0
    near_tie: int = 0
    different: list[str] = field(default_factory=list)
    max_drift: float = 0.0
    kv_cells_after_erase: int = -1
    kv_cells_pool: int = -1
    server_alive: bool = True
    #: requests whose prompt processing covered part of the shared prefix
    prefix_recomputed: list[str] = field(default_factory=list)

    @property
    def leak(self) -> int:
        return self.kv_cells_after_erase - self.kv_cells_pool

    @property
    def ok(self) -> bool:
        return (
            not self.errors
            and not self.different
            and not self.prefix_recomputed
            and self.server_alive
            and self.leak == 0
            and set(self.statuses) <= {"hit", "own_cache"}
        )


@dataclass
class LoadReport:
    config: dict[str, Any]
    pool_cells: int
    prefix_tokens: list[int]
    reference_s: float
    rounds: list[RoundResult]
    server_rss_mb: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.rounds) and all(r.ok for r in self.rounds)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for r, rr in zip(out["rounds"], self.rounds, strict=True):
            r["leak"], r["ok"] = rr.leak, rr.ok
        out["ok"] = self.ok
        return out


def load_server(cfg: LoadConfig) -> LlamaServer:
    """A patched server for :func:`run_load` (not started): the fan-out's pool server, pool slot reserved."""
    from ..presets import pool_server

    # room for the pool plus every slot's prompt and answer at once, with margin
    ctx = cfg.pool_tokens + cfg.n_slots * (cfg.suffix_tokens + cfg.n_predict + 16) + 256
    server: LlamaServer = pool_server(
        model=cfg.model,
        n_agents_parallel=cfg.n_slots,
        ctx=ctx,
        threads=cfg.threads,
        track_kv=True,
        name="load",
        pool_slot=POOL,
    )
    return server


async def _erase_agents(c: AsyncClient, n_slots: int) -> None:
    for s in range(1, n_slots + 1):
        await c.erase_slot(s)


async def _cells_in_use(c: AsyncClient, kv: KVCellsLog) -> int:
    """Cells in use right now: read from the first micro-batch of a one-token probe on slot 1."""
    kv.mark()
    await c.completion("Hi", id_slot=1, n_predict=1, cache_prompt=False)
    await c.erase_slot(1)
    reading = kv.read()
    if reading.samples != 1:
        raise RuntimeError(
            f"expected one find_slot line for the probe, got {reading.samples} (is LLAMA_KV_CACHE_DEBUG=1 -lv 5 set?)"
        )
    return reading.last  # logged before the probe's token is placed


async def _ask(c: AsyncClient, prompt: str, p: int, cfg: LoadConfig) -> dict[str, Any]:
    return await asyncio.wait_for(
        c.completion(
            prompt, share=Share(POOL, p), n_predict=cfg.n_predict, temperature=0, n_probs=2, cache_prompt=True
        ),
        cfg.request_timeout,
    )


async def run_load_async(server: LlamaServer, cfg: LoadConfig, progress: bool = False) -> LoadReport:
    """Run the rounds against a started :func:`load_server`."""
    from .benchmark import make_inputs

    base, (suffixes,) = make_inputs(server, cfg.pool_tokens, cfg.n_agents, cfg.suffix_tokens)
    kv = KVCellsLog(server.log_path)
    async with server.async_client(timeout=cfg.request_timeout + 30) as c:
        await c.prime(base, POOL, n_predict=1)
        pool_cells = await _cells_in_use(c, kv)
        prompts = [base + s for s in suffixes]
        prefix = [await c.shared_prefix_len(base, p) for p in prompts]

        t0 = time.monotonic()
        reference = []
        for prompt, p in zip(prompts, prefix, strict=True):
            reference.append(await _ask(c, prompt, p, cfg))
            await _erase_agents(c, cfg.n_slots)
        reference_s = time.monotonic() - t0

        sem = asyncio.Semaphore(cfg.n_slots)

        async def agent(i: int) -> dict[str, Any] | BaseException:
            async with sem:
                try:
                    return await _ask(c, prompts[i], prefix[i], cfg)
                except Exception as exc:  # recorded per request, the round goes on
                    return exc

        rounds: list[RoundResult] = []
        rss = 0.0
        for r in range(cfg.rounds):
            t = time.monotonic()
            outs = await asyncio.gather(*[agent(i) for i in range(cfg.n_agents)])
            rr = RoundResult(round=r + 1, wall_s=round(time.monotonic() - t, 2))
            statuses: Counter[str] = Counter()
            for i, out in enumerate(outs):
                if isinstance(out, BaseException):
                    rr.errors.append(f"agent {i}: {type(out).__name__}: {out}")
                    continue
                sp = out.get("shared_prefix") or {}
                status = sp.get("status", "missing")
                if status == "hit" and sp.get("shared") != prefix[i]:
                    status = f"hit_partial({sp.get('shared')}/{prefix[i]})"
                statuses[status] += 1
                processed = int((out.get("timings") or {}).get("prompt_n", -1))
                if not 0 <= processed <= int(out.get("tokens_evaluated", 0)) - prefix[i]:
                    rr.prefix_recomputed.append(
                        f"agent {i}: processed {processed} of {out.get('tokens_evaluated')}"
                        f" prompt tokens, P = {prefix[i]} ({status})"
                    )
                cmp = compare_greedy(reference[i], out)
                rr.max_drift = max(rr.max_drift, round(cmp.max_drift, 4))
                if cmp.verdict == "identical":
                    rr.identical += 1
                elif cmp.verdict == "near_tie":
                    rr.near_tie += 1
                else:
                    rr.different.append(f"agent {i}: {cmp.detail}")
            rr.statuses = dict(statuses)
            rr.server_alive = server.is_alive()
            if rr.server_alive:
                rss = max(rss, server.usage().rss_bytes / 2**20)
                await _erase_agents(c, cfg.n_slots)
                rr.kv_cells_after_erase = await _cells_in_use(c, kv)
                rr.kv_cells_pool = pool_cells
            rounds.append(rr)
            msg = (
                f"round {rr.round}/{cfg.rounds}: {rr.wall_s:.1f} s, {len(rr.errors)} errors, "
                f"{rr.identical} identical + {rr.near_tie} near-tie / {cfg.n_agents}, leak {rr.leak} cells"
            )
            (print if progress else log.info)(msg)
            if not rr.server_alive:
                break
    return LoadReport(
        config=asdict(cfg),
        pool_cells=pool_cells,
        prefix_tokens=sorted(set(prefix)),
        reference_s=round(reference_s, 2),
        rounds=rounds,
        server_rss_mb=round(rss, 1),
    )


def run_load(cfg: LoadConfig, progress: bool = False) -> LoadReport:
    """Start a server, run the load, stop the server."""
    with load_server(cfg).start() as server:
        return asyncio.run(run_load_async(server, cfg, progress))

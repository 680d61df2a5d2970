"""Load test: many agents in rounds over one reserved pool, checked against the reference server.

Each agent asks its own question about a ``pool_tokens``-token base: the sample design
document (:func:`polykv_py.data.sample_document`) cut to that many tokens, followed by one
of :data:`polykv_py.data.questions.QUESTIONS` (numbered per agent, so every prompt differs
and every answer depends on what the base holds).

Reference: the pristine server (:func:`polykv_py.presets.reference_server`) answers every
agent's request alone, *unshared*, from its own cache after the same priming request as the
pool's: slot s is primed with the base, then base + question is sent pinned to slot s, so it
computes the same tokens ``[P, n_prompt)`` in one batch over the same base KV, like a
sharer does (docs/design-notes.md, "Compare like with like"; its ``timings.prompt_n`` is
checked to be ``n_prompt - P``). Slot s is primed once, saved with ``/slots?action=save``
and restored before each agent: the restored cells are the priming request's own KV, bit
for bit, without a prefill per agent.

Then one patched server (unified KV, ``--pool-slots 0``, ``n_slots`` agent slots) holds the
base in its pool, and ``rounds`` times all ``n_agents`` ask, at most ``n_slots`` in flight,
each request bounded in time.  Every round checks:

- no request failed, the server is alive, no request recomputed its P-token prefix
  (status ``hit``, or ``own_cache`` when its slot still held the shared cells from an
  earlier agent of the round);
- every answer equals the reference's: identical, or diverging only at a near tie
  (:func:`polykv_py.harness.compare.compare_greedy` with :data:`~polykv_py.harness.compare.LAYOUT`:
  concurrent requests sit in other KV cells and the CPU attention kernels round by cell order);
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
from ..data import sample_document
from ..data.questions import QUESTIONS
from ..llama_server import LlamaServer
from .compare import LAYOUT, compare_greedy
from .kvcells import KVCellsLog
from .texts import Detokenize, Tokenize, repeat_to_tokens

log = logging.getLogger(__name__)

POOL = 0
#: The reference server's slot: primed with the base, saved, restored before each agent.
REFERENCE_SLOT = 0
#: File name (under the reference's ``--slot-save-path``) of the primed base.
REFERENCE_STATE = "load-base.bin"
#: KV cells each agent's question may take (the longest question, numbered, is about 30 tokens).
QUESTION_ROOM = 48


@dataclass(frozen=True)
class LoadConfig:
    """One load run (the defaults are bench/reliability.py's full run)."""

    #: the patched server: agent slots (the requests in flight at most), CPU threads and GGUF (None: the defaults)
    n_slots: int = 16
    threads: int | None = None
    model: str | None = None
    #: the work: a base of ``pool_tokens`` in the reserved pool, ``rounds`` of ``n_agents`` greedy answers
    pool_tokens: int = 2048
    n_agents: int = 64
    rounds: int = 10
    n_predict: int = 16  # tokens per answer
    request_timeout: float = 300.0  # seconds one request may take


def load_base(pool_tokens: int, tokenize: Tokenize, detokenize: Detokenize) -> str:
    """The base: the sample document cut to ``pool_tokens`` tokens (repeated first if it is shorter)."""
    return repeat_to_tokens(sample_document(), pool_tokens, tokenize, detokenize)


def load_questions(n_agents: int) -> list[str]:
    """Each agent's suffix: a question about the sample document, numbered so that no two prompts are equal."""
    return [f"\n\nQuestion {i + 1}: {QUESTIONS[i % len(QUESTIONS)][0]}\nAnswer:" for i in range(n_agents)]


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
class Reference:
    """The reference server's unshared answers, one per agent, and the seconds they took one after another."""

    answers: list[dict[str, Any]]
    wall_s: float


@dataclass
class LoadReport:
    config: dict[str, Any]
    pool_cells: int
    prefix_tokens: list[int]
    reference_s: float
    rounds: list[RoundResult]
    server_rss_mb: float = 0.0
    #: agents whose reference answer did not compute exactly ``n_prompt - P`` prompt tokens (not like with like)
    reference_split: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rounds) and all(r.ok for r in self.rounds) and not self.reference_split

    def verdicts(self) -> dict[str, float]:
        """Comparator verdicts over all rounds (identical, near_tie, different) and the largest drift."""
        return {
            "identical": sum(r.identical for r in self.rounds),
            "near_tie": sum(r.near_tie for r in self.rounds),
            "different": sum(len(r.different) for r in self.rounds),
            "max_drift": max((r.max_drift for r in self.rounds), default=0.0),
        }

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for r, rr in zip(out["rounds"], self.rounds, strict=True):
            r["leak"], r["ok"] = rr.leak, rr.ok
        out["verdicts"] = self.verdicts()
        out["ok"] = self.ok
        return out


def load_server(cfg: LoadConfig) -> LlamaServer:
    """A patched server for :func:`run_load` (not started): the fan-out's pool server, pool slot reserved."""
    from ..presets import pool_server

    # room for the pool plus every slot's prompt and answer at once, with margin
    ctx = cfg.pool_tokens + cfg.n_slots * (QUESTION_ROOM + cfg.n_predict + 16) + 256
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


def reference_for(cfg: LoadConfig) -> LlamaServer:
    """The reference server for :func:`run_load` (not started): pristine, one slot, room for the base and one agent."""
    from ..presets import reference_server

    ctx = cfg.pool_tokens + QUESTION_ROOM + cfg.n_predict + 256
    server: LlamaServer = reference_server(
        model=cfg.model, n_slots=1, ctx=ctx, threads=cfg.threads, name="load-reference"
    )
    return server


def _params(cfg: LoadConfig) -> dict[str, Any]:
    """The agents' generation parameters (greedy, with the log-probs the comparator needs)."""
    return {"n_predict": cfg.n_predict, "temperature": 0, "n_probs": 2, "cache_prompt": True}


async def reference_answers(ref: LlamaServer, base: str, prompts: list[str], cfg: LoadConfig) -> Reference:
    """Every prompt answered alone by the started reference ``ref``, from its own cache of ``base``.

    The slot is primed with ``base`` as the pool is, saved, and restored before each prompt, so each
    answer computes only its tokens after the base, over the priming request's KV (see the module docstring).
    """
    slot = REFERENCE_SLOT
    async with ref.async_client(timeout=cfg.request_timeout + 30) as c:
        await c.prime(base, slot, n_predict=1)
        await c.post_json(f"/slots/{slot}?action=save", {"filename": REFERENCE_STATE})
        t0 = time.monotonic()
        answers = []
        for prompt in prompts:
            await c.post_json(f"/slots/{slot}?action=restore", {"filename": REFERENCE_STATE})
            answer = c.completion(prompt, id_slot=slot, **_params(cfg))
            answers.append(await asyncio.wait_for(answer, cfg.request_timeout))
    return Reference(answers, round(time.monotonic() - t0, 2))


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
    return await asyncio.wait_for(c.completion(prompt, share=Share(POOL, p), **_params(cfg)), cfg.request_timeout)


def _split_errors(reference: Reference, prefix: list[int]) -> list[str]:
    """Reference answers that did not compute exactly ``n_prompt - P`` tokens (their split is not the share's)."""
    out = []
    for i, (ans, p) in enumerate(zip(reference.answers, prefix, strict=True)):
        n_prompt, prompt_n = int(ans.get("tokens_evaluated", -1)), int((ans.get("timings") or {}).get("prompt_n", -1))
        if prompt_n != n_prompt - p:
            out.append(f"agent {i}: the reference computed {prompt_n} of {n_prompt} prompt tokens, P = {p}")
    return out


async def run_load_async(
    server: LlamaServer, base: str, prompts: list[str], reference: Reference, cfg: LoadConfig, progress: bool = False
) -> LoadReport:
    """Run the rounds against a started :func:`load_server`, comparing with :func:`reference_answers`."""
    kv = KVCellsLog(server.log_path)
    async with server.async_client(timeout=cfg.request_timeout + 30) as c:
        await c.prime(base, POOL, n_predict=1)
        pool_cells = await _cells_in_use(c, kv)
        prefix = [await c.shared_prefix_len(base, p) for p in prompts]
        reference_split = _split_errors(reference, prefix)

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
                cmp = compare_greedy(reference.answers[i], out, margins=LAYOUT)
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
                f"{rr.identical} identical + {rr.near_tie} near-tie + {len(rr.different)} different "
                f"/ {cfg.n_agents} (max drift {rr.max_drift}), leak {rr.leak} cells"
            )
            (print if progress else log.info)(msg)
            if not rr.server_alive:
                break
    return LoadReport(
        config=asdict(cfg),
        pool_cells=pool_cells,
        prefix_tokens=sorted(set(prefix)),
        reference_s=reference.wall_s,
        rounds=rounds,
        server_rss_mb=round(rss, 1),
        reference_split=reference_split,
    )


def run_load(cfg: LoadConfig, progress: bool = False) -> LoadReport:
    """Answer every agent on the reference server, then run the rounds on the patched server (one at a time)."""
    with reference_for(cfg).start() as ref:
        c = ref.client
        base = load_base(cfg.pool_tokens, c.tokenize, c.detokenize)
        prompts = [base + q for q in load_questions(cfg.n_agents)]
        reference = asyncio.run(reference_answers(ref, base, prompts, cfg))
    (print if progress else log.info)(f"reference: {cfg.n_agents} answers alone in {reference.wall_s} s")
    with load_server(cfg).start() as server:
        return asyncio.run(run_load_async(server, base, prompts, reference, cfg, progress))

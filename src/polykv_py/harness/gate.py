"""The gate: six checks on the default model, a JSON report, an exit status.

The reference server is llama-server built from the pristine pinned tree with its own static ggml, llama
and common (cmake/reference_server.cmake): nothing it runs comes from the patched build, so a change the
patch series makes to ggml or common with every polykv option off shows in ``default_output``.

1. ``default_output``: the same requests (completion, /v1/completions and chat;
   stream and non-stream; greedy and seeded; with probabilities; several slots at
   once, behind a streamed lead so that both servers batch them alike: :func:`_gather`)
   to the patched server *without* pool fields and to the reference server,
   same flags.  Answers must be byte-identical once :data:`VOLATILE_FIELDS` are removed.
2. ``share_hit``: boot with ``--no-clear-idle -kvu -np 4``, prime the pool slot with a
   deterministic base context, send sharers whose P is the common prefix of the
   *tokenized* pool prompt and the tokenized full prompt.  Each must report a hit,
   process only ``n_prompt - P`` tokens, and answer byte-identically to the reference
   server answering the same request from its own cache after the same priming (the sharer's first P
   tokens on both: :attr:`Sharer.prefix_tokens`).
   Sent all at once, each must hit too, and each greedy one answer like it did alone
   (:func:`~polykv_py.harness.compare.compare_greedy`, :data:`~polykv_py.harness.compare.LAYOUT`
   margins: identical or a near tie, never different).
3. ``fallback_miss``: boot without ``--no-clear-idle`` (upstream idle-slot caching,
   ``-kvu``): the pool is evicted, each sharer reports ``not_resident``, re-processes
   its whole prompt, and answers byte-identically to the reference server given the
   same sequence of requests; the server stays healthy.
4. ``auto_share``: boot with ``--pool-slots 0 --pool-auto``, prime the pool, send each sharer's
   request with no pool field and no ``id_slot``: it must hit the pool by itself (``"auto":
   "pool"``, P computed by the server) and answer byte-identically to the reference server's
   own-cache answer after the same priming.
5. ``shared_decode`` (reporting): the sharers of ``share_hit`` at once on two patched servers that differ
   only in ``--shared-decode`` (patch 0076; every other check runs with it off): each greedy answer with
   it on against the same answer with it off, :data:`~polykv_py.harness.compare.LAYOUT` margins; fails
   only on ``different`` (or if the path never ran).
6. ``share_any``: zero-config sharing as ``polykv serve`` runs it (``--share-any``, plain requests):
   all at once with shared decode on, all but the first share and the server computes at most the
   common prefix plus the suffixes; one at a time with it off, each shares exactly its prefix with a
   leader's prompt and answers byte-identically to the reference's own cache; another ``cache_salt``
   shares nothing (:func:`check_share_any`).

Library code logs through ``logging``; :func:`main` routes that to the terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from ..client import AsyncClient, Client, Share, aggregate
from ..errors import PolykvError
from ..jsontypes import Json
from ..llama_server import LlamaServer
from ..models import resolve_model
from ..native import ServerKind, server_binary
from ..presets import NO_CACHE_IDLE, NO_CLEAR_IDLE, NO_HOST_CACHE, UNIFIED_KV, serve_args, slots_args
from ..tokens import common_prefix_len
from .answers import SHARE_FIELDS, VOLATILE_FIELDS, Answer, compare
from .compare import LAYOUT, compare_greedy

log = logging.getLogger(__name__)


CHECKS = ("default_output", "share_hit", "fallback_miss", "auto_share", "shared_decode", "share_any")

POOL_SLOT = 0
#: Slots of the checks' servers at least: the pool slot and one slot per sharer (:func:`n_slots`).
N_SLOTS = 4
#: The comparator's verdicts (:mod:`polykv_py.harness.compare`), and what a sampled sharer gets instead.
COMPARE_VERDICTS = ("identical", "near_tie", "different")
NOT_COMPARED = "not_compared_sampled"

PROMPTS = (
    "The three most important rules for writing maintainable software are",
    "Once upon a time, in a village at the edge of a forest,",
    "Q: What is the boiling point of water at sea level?\nA:",
    "def fibonacci(n):\n    ",
)
CHAT = (
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name two uses of a paperclip."},
    ],
    [{"role": "user", "content": "Write one sentence about the sea."}],
)
QUESTIONS = (
    "Question: According to the handbook, which team owns the billing service?\nAnswer:",
    "Question: Summarise rule 3 of the handbook in one sentence.\nAnswer:",
    "Question: What should an agent do before changing a shared schema?\nAnswer:",
    "Question: List two services mentioned in section 2.\nAnswer:",
)


@dataclass
class GateConfig:
    """What the gate runs on and how big it is."""

    model: Path | None = None
    patched_bin: Path | None = None
    upstream_bin: Path | None = None
    share_server: ServerKind = ServerKind.PATCHED
    checks: tuple[str, ...] = CHECKS
    threads: int = 2
    ctx: int = 8192
    n_predict: int = 16
    n_probs: int = 5  # sharers ask for at least 2: the together-vs-alone comparison needs the runner-up
    base_tokens: int = 1200
    n_sharers: int = 3
    log_dir: Path | None = None
    start_timeout: float = 180.0
    fresh_info: bool = True  # also measure fresh one-pass answers (informational, two extra prefills per sharer)
    # appended to every server's arguments, patched and reference alike (e.g. ("-ngl", "99") for a GPU backend)
    server_args: tuple[str, ...] = ()


@dataclass
class Case:
    """One request of a check."""

    name: str
    endpoint: str
    body: Json
    group: int = 0  # cases with the same non-zero group are sent concurrently
    # a group's lead (streamed) goes first; the rest of the group once its first token is back (see _gather)
    lead: bool = False

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class CheckResult:
    """Outcome of one check."""

    name: str
    ok: bool = False
    summary: str = ""
    cases: list[Json] = field(default_factory=list)
    info: Json = field(default_factory=dict)
    duration_s: float = 0.0


# ------------------------------------------------------------------ comparison
def final_of(doc: Answer, endpoint: str) -> Json:
    """The aggregated result of a stream, or the body itself."""
    return doc if isinstance(doc, dict) else aggregate(endpoint, doc)


def first_token_logprob_diff(a: Json, b: Json) -> float | None:
    """Max |logprob difference| over the first-token candidates both answers list."""
    try:
        pa = {p["id"]: p["logprob"] for p in a["completion_probabilities"][0]["top_logprobs"]}
        pb = {p["id"]: p["logprob"] for p in b["completion_probabilities"][0]["top_logprobs"]}
    except (KeyError, IndexError, TypeError):
        return None
    common = set(pa) & set(pb)
    return max((abs(pa[t] - pb[t]) for t in common), default=None)


# ------------------------------------------------------------------ requests
def send(client: Client, case: Case) -> Answer:
    """Send one case; a stream comes back as its list of chunks."""
    if case.stream:
        return list(client.stream_events(case.endpoint, case.body))
    return client.post_json(case.endpoint, case.body)


async def _send_async(client: AsyncClient, case: Case) -> Answer:
    if case.stream:
        return [chunk async for chunk in client.stream_events(case.endpoint, case.body)]
    return await client.post_json(case.endpoint, case.body)


def run_cases(server: LlamaServer, cases: Sequence[Case]) -> dict[str, Answer]:
    """Send ``cases`` in order; consecutive cases of one non-zero group go out concurrently."""
    out: dict[str, Answer] = {}
    i = 0
    while i < len(cases):
        group = [cases[i]]
        if cases[i].group:
            while i + len(group) < len(cases) and cases[i + len(group)].group == cases[i].group:
                group.append(cases[i + len(group)])
        if len(group) == 1:
            out[group[0].name] = send(server.client, group[0])
        else:
            for case, answer in zip(group, asyncio.run(_gather(server, group)), strict=True):
                out[case.name] = answer
        i += len(group)
    return out


async def _gather(server: LlamaServer, cases: Sequence[Case]) -> list[Answer]:
    """``cases`` at once, answers in their order.

    A lead case (:attr:`Case.lead`, a stream) goes first, and the others only once its first token has come
    back: they then reach the server while it decodes the lead's next token, so its loop starts them in one
    batch. Sent all at once without a lead, which request makes the first batch depends on which HTTP thread
    is quicker; the CPU backend's answers do not depend on that, Vulkan's do (measured on lavapipe: the third
    request joined one step later on the patched server than on the reference, and two answers differed).
    """
    async with server.async_client() as client:
        first_token = asyncio.Event()

        async def lead(case: Case) -> Answer:
            chunks: list[Json] = []
            try:
                async for chunk in client.stream_events(case.endpoint, case.body):
                    chunks.append(chunk)
                    first_token.set()
            finally:
                first_token.set()
            return chunks

        leads = {c.name: asyncio.create_task(lead(c)) for c in cases if c.lead}
        if leads:
            await first_token.wait()
        rest = {c.name: asyncio.create_task(_send_async(client, c)) for c in cases if not c.lead}
        tasks = leads | rest
        await asyncio.gather(*tasks.values())
        return [tasks[c.name].result() for c in cases]


def default_output_cases(n_predict: int, n_probs: int) -> list[Case]:
    """The request set of the default-output check."""
    greedy = {"temperature": 0.0}
    seeded = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 42}
    cases: list[Case] = []
    variants = ((greedy, "greedy", PROMPTS[0], CHAT[0]), (seeded, "seeded", PROMPTS[1], CHAT[1]))
    for sampling, sname, prompt, chat in variants:
        for stream in (False, True):
            suffix = f"{sname}/{'stream' if stream else 'plain'}"
            cases.append(
                Case(
                    f"completion/{suffix}",
                    "/completion",
                    {"prompt": prompt, "n_predict": n_predict, "n_probs": n_probs, **sampling, "stream": stream},
                )
            )
            cases.append(
                Case(
                    f"chat/{suffix}",
                    "/v1/chat/completions",
                    {
                        "messages": chat,
                        "max_tokens": n_predict,
                        "logprobs": True,
                        "top_logprobs": n_probs,
                        **sampling,
                        "stream": stream,
                    },
                )
            )
    for stream in (False, True):
        cases.append(
            Case(
                f"v1-completions/greedy/{'stream' if stream else 'plain'}",
                "/v1/completions",
                {
                    "prompt": PROMPTS[2],
                    "max_tokens": n_predict,
                    "logprobs": n_probs,
                    "temperature": 0.0,
                    "stream": stream,
                },
            )
        )
    # several slots at once
    cases += [
        Case(
            "concurrent/slot1/completion",
            "/completion",
            {"prompt": PROMPTS[3], "n_predict": n_predict, "n_probs": n_probs, "temperature": 0.0, "id_slot": 1},
            1,
        ),
        Case(
            "concurrent/slot2/completion-seeded-stream",
            "/completion",
            # the group's lead: the others follow once its first token is back, so it must outlast their start
            {
                "prompt": PROMPTS[0],
                "n_predict": n_predict,
                "n_probs": n_probs,
                **seeded,
                "id_slot": 2,
                "stream": True,
                "ignore_eos": True,
            },
            1,
            lead=True,
        ),
        Case(
            "concurrent/slot3/chat",
            "/v1/chat/completions",
            {"messages": CHAT[1], "max_tokens": n_predict, "temperature": 0.0, "id_slot": 3},
            1,
        ),
    ]
    return cases


# ------------------------------------------------------------------ base context
_WORDS = ("agent", "service", "schema", "billing", "queue", "cache", "review", "deploy", "owner", "team", "ticket",
          "release", "incident", "latency", "budget", "contract", "storage", "index", "shard", "replica", "token",
          "request", "response", "metric", "alert", "runbook", "branch", "merge", "test", "module")  # fmt: skip
_TEAMS = ("Atlas", "Borealis", "Cobalt", "Delta", "Ember", "Fjord")


def base_sections(seed: int = 1234) -> list[str]:
    """Deterministic sections of a fake engineering handbook (no downloads)."""
    rng = random.Random(seed)
    sections: list[str] = ["ENGINEERING HANDBOOK\n\nThis handbook is shared by every agent working on the platform.\n"]
    for n in range(1, 200):
        team = rng.choice(_TEAMS)
        lines = [f"Section {n}. The {rng.choice(_WORDS)} {rng.choice(_WORDS)} is owned by team {team}."]
        for r in range(1, 4):
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 12)))
            lines.append(f"Rule {n}.{r}: every {rng.choice(_WORDS)} must {words}.")
        sections.append("\n".join(lines) + "\n")
    return sections


def build_base(tokenize: Callable[[str], list[int]], n_tokens: int) -> str:
    """A base context of at least ``n_tokens`` tokens, ending in a blank line ("\\n\\n")."""
    text = ""
    for section in base_sections():
        text += section + "\n"
        if len(tokenize(text + "\n")) >= n_tokens:
            break
    return text + "\n"


@dataclass
class Sharer:
    """One agent request over the base context."""

    index: int
    slot: int
    prompt: str
    p: int  # shared prefix length, from the tokenized prompts
    tokens: list[int]  # the prompt as /completion evaluates it
    body: Json

    @property
    def n_prompt(self) -> int:
        return len(self.tokens)

    @property
    def prefix_tokens(self) -> list[int]:
        """The first P tokens of the prompt: what an exact phase primes on both servers.

        Priming with the base text instead leaves the base's own last token in the pool's cells when it merges
        with the question (P is then one less than the base's tokens): the sharer's suffix starts one cell
        later than in the reference, whose own cache frees that cell and fills it. On the CPU backend the
        answers agreed all the same; on Vulkan they did not (lavapipe: first-token logprob -0.94116 vs -0.94603
        with the pool primed with the base, byte-identical with exactly P tokens), so only a prefix of exactly
        P tokens lays both servers' cells out alike on every backend.
        """
        return self.tokens[: self.p]

    @property
    def case(self) -> Case:
        return Case(f"sharer{self.index}/slot{self.slot}", "/completion", self.body)

    def with_pool(self, group: int = 0) -> Case:
        body = {**self.body, **Share(POOL_SLOT, self.p).fields()}
        return Case(self.case.name + "/pool", "/completion", body, group)

    def fresh(self) -> Case:
        return Case(self.case.name + "/fresh", "/completion", {**self.body, "cache_prompt": False})


def make_sharers(client: Client, base: str, cfg: GateConfig) -> tuple[list[Sharer], Json]:
    """Sharers with P computed from the tokenized pool prompt and tokenized full prompts."""
    base_tokens = client.prompt_tokens(base)
    samplings: tuple[Json, ...] = (
        {"temperature": 0.0},
        {"temperature": 0.8, "top_k": 40, "seed": 42},
        {"temperature": 0.0, "stream": True},
    )
    sharers = []
    for i in range(cfg.n_sharers):
        prompt = base + QUESTIONS[i % len(QUESTIONS)]
        tokens = client.prompt_tokens(prompt)
        p = common_prefix_len(base_tokens, tokens)
        slot = 1 + i % (n_slots(cfg) - 1)
        body = {
            "prompt": prompt,
            "n_predict": cfg.n_predict,
            "n_probs": max(cfg.n_probs, 2),
            "id_slot": slot,
            **samplings[i % len(samplings)],
        }
        sharers.append(Sharer(i + 1, slot, prompt, p, tokens, body))
    info = {
        "base_chars": len(base),
        "base_tokens_alone": len(base_tokens),
        "shared_prefix_p": [s.p for s in sharers],
        "n_prompt": [s.n_prompt for s in sharers],
    }
    return sharers, info


# ------------------------------------------------------------------ servers
def no_clear_idle_flag(binary: Path) -> str:
    """``--no-clear-idle`` if the binary knows it, else upstream's ``--no-cache-idle-slots``."""
    try:
        out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return NO_CACHE_IDLE
    return NO_CLEAR_IDLE if NO_CLEAR_IDLE in out.stdout + out.stderr else NO_CACHE_IDLE


class _Servers:
    """Starts the servers of the checks; resolves each binary only when first needed."""

    def __init__(self, cfg: GateConfig) -> None:
        self.cfg = cfg
        self.model = resolve_model(cfg.model)
        self._given = {ServerKind.PATCHED: cfg.patched_bin, ServerKind.UPSTREAM: cfg.upstream_bin}
        self.bins: dict[ServerKind, Path] = {}

    def binary(self, kind: ServerKind | str) -> Path:
        kind = ServerKind.of(kind)
        if kind not in self.bins:
            given = self._given[kind]
            self.bins[kind] = Path(given) if given else server_binary(kind)
        return self.bins[kind]

    def start(self, kind: ServerKind | str, args: list[str], name: str) -> LlamaServer:
        srv = LlamaServer(
            self.binary(kind),
            self.model,
            [*args, *self.cfg.server_args],
            kind=kind,
            threads=self.cfg.threads,
            log_dir=self.cfg.log_dir,
            name=name,
            start_timeout=self.cfg.start_timeout,
        )
        srv.start()
        log.info("  started %s: %s (log %s)", name, " ".join(srv.command(srv.port)[3:]), srv.log_path)
        return srv


def _base_args(cfg: GateConfig) -> list[str]:
    """Unified KV, :func:`n_slots` slots; idle-slot caching as upstream's default (each check adds what it needs)."""
    return [*slots_args(n_slots(cfg), cfg.ctx), UNIFIED_KV]


def n_slots(cfg: GateConfig) -> int:
    """The pool slot and a slot of its own for each sharer (two sharers pinned to one slot would find the first's
    prompt in its cache), at least :data:`N_SLOTS`."""
    return max(N_SLOTS, cfg.n_sharers + 1)


# ------------------------------------------------------------------ checks
def check_default_output(servers: _Servers) -> CheckResult:
    """Patched without pool fields vs reference, same flags, same requests."""
    cfg = servers.cfg
    res = CheckResult("default_output")
    cases = default_output_cases(cfg.n_predict, cfg.n_probs)
    args = _base_args(cfg)
    res.info = {"flags": args, "volatile_fields": list(VOLATILE_FIELDS), "n_requests": len(cases)}
    answers: dict[str, dict[str, Answer]] = {}
    for kind in ("upstream", "patched"):
        with servers.start(kind, args, f"default-{kind}") as srv:
            answers[kind] = run_cases(srv, cases)
            if not srv.is_alive():
                raise PolykvError(f"{kind} server died during the default-output requests")
    for case in cases:
        ok, diff = compare(
            answers["patched"][case.name], answers["upstream"][case.name], VOLATILE_FIELDS, VOLATILE_FIELDS
        )
        final = final_of(answers["patched"][case.name], case.endpoint)
        text = (
            final.get("content")
            or (final.get("choices") or [{}])[0].get("text")
            or ((final.get("choices") or [{}])[0].get("message") or {}).get("content")
        )
        res.cases.append(
            {
                "name": case.name,
                "ok": ok,
                "difference": diff,
                "text": text,
                "chunks": len(answers["patched"][case.name]) if case.stream else None,
            }
        )
        log.info("  %-45s %s%s", case.name, "identical" if ok else "DIFFERENT: ", diff)
    bad = [c["name"] for c in res.cases if not c["ok"]]
    res.ok = not bad
    res.summary = (
        f"{len(cases)} requests byte-identical to the reference server (after removing only "
        f"{', '.join(VOLATILE_FIELDS)})"
        if res.ok
        else f"{len(bad)}/{len(cases)} answers differ: {bad}; {bad[0]}: {_first_difference(res.cases, bad[0])}"
    )
    return res


def _first_difference(cases: list[Json], name: str) -> str:
    """What the report says differs in case ``name``, cut to a line."""
    diff = next(c["difference"] for c in cases if c["name"] == name)
    return str(diff)[:300]


def _sharer_verdict(answer: Json, sharer: Sharer, expect: str) -> tuple[bool, str, Json]:
    sp = answer.get("shared_prefix")
    prompt_n = (answer.get("timings") or {}).get("prompt_n")
    got = {"shared_prefix": sp, "prompt_n": prompt_n, "tokens_evaluated": answer.get("tokens_evaluated")}
    if sp is None:
        return (
            False,
            (
                "no shared_prefix field in the response: the server ignored shared_pool_slot "
                "(is this the patched server?)"
            ),
            got,
        )
    if sp.get("status") != expect:
        return False, f"shared_prefix.status is {sp.get('status')!r}, expected {expect!r} ({sp})", got
    if expect == "hit":
        # P covering the whole prompt: the server recomputes the last token for its logits and reports P - 1
        shared = sharer.p - 1 if sharer.p >= sharer.n_prompt else sharer.p
        if sp.get("shared") != shared or sp.get("requested") != sharer.p:
            return (
                False,
                (
                    f"shared_prefix reports requested={sp.get('requested')} shared={sp.get('shared')}, "
                    f"expected requested={sharer.p} shared={shared} (P={sharer.p}, n_prompt={sharer.n_prompt})"
                ),
                got,
            )
        want = sharer.n_prompt - shared
        if prompt_n != want:
            return False, f"processed {prompt_n} prompt tokens, expected n_prompt - shared = {want}", got
        return True, f"hit, shared {shared}, processed {prompt_n} = {sharer.n_prompt} - {shared}", got
    if prompt_n != sharer.n_prompt:
        return False, f"processed {prompt_n} prompt tokens, expected the full prompt ({sharer.n_prompt})", got
    return True, f"miss reported ({expect}), full prompt of {prompt_n} tokens re-processed", got


def _sharer_case(
    s: Sharer, verdict: tuple[bool, str, Json], mine: Answer, ref: Answer, same_key: str, ignore: tuple[str, ...] = ()
) -> Json:
    """A sharer's entry in a check's report: the verdict on its status, and its answer byte-compared with the
    reference server's (``same_key`` names that comparison; ``ignore``: more fields left out on both sides)."""
    ok_status, why, got = verdict
    same, diff = compare(mine, ref, VOLATILE_FIELDS + SHARE_FIELDS + ignore, VOLATILE_FIELDS + ignore)
    return {"name": s.case.name, "ok": ok_status and same, "P": s.p, "n_prompt": s.n_prompt, **got,
            "status_ok": ok_status, "status_check": why, same_key: same, "difference": diff}  # fmt: skip


def _sameness(case: Json) -> str:
    return "identical" if not case["difference"] else f"DIFFERENT: {case['difference']}"


def _failed_sharers(bad: list[Json], n: int, where: str = "") -> str:
    """The summary of a check whose sharers failed: how many, and why the first did."""
    first = bad[0]
    reason = first["status_check"] if not first["status_ok"] else f"output differs: {first['difference']}"
    return f"{len(bad)}/{n} sharers failed{where}; {first['name']}: {reason}"


@dataclass
class _Together:
    """The sharers sent at once over one primed pool: what :func:`_together` saw."""

    base: str
    sharers: list[Sharer]
    sharers_info: Json  # from make_sharers: base tokens, P and n_prompt per sharer
    prime_prompt_n: int | None  # tokens the pool's priming computed
    answers: dict[str, Answer]  # by each sharer's with_pool() case name
    health: str  # the server's health after the sharers
    props: Json  # the server's /props after the sharers

    def final(self, s: Sharer) -> Json:
        """Sharer ``s``'s final answer."""
        return final_of(self.answers[s.with_pool().name], "/completion")


def _together(servers: _Servers, kind: ServerKind | str, args: list[str], name: str) -> _Together:
    """A fresh ``kind`` server: the base built, the pool primed once, every sharer sent at once (one group)."""
    cfg = servers.cfg
    with servers.start(kind, args, name) as srv:
        base = build_base(srv.client.prompt_tokens, cfg.base_tokens)
        sharers, sinfo = make_sharers(srv.client, base, cfg)
        prime_n = (srv.client.prime(base, POOL_SLOT).get("timings") or {}).get("prompt_n")
        log.info(
            "  pool slot %d primed with %s base tokens; P per sharer %s (the base alone tokenizes to %d)",
            POOL_SLOT,
            prime_n,
            sinfo["shared_prefix_p"],
            sinfo["base_tokens_alone"],
        )
        answers = run_cases(srv, [s.with_pool(group=1) for s in sharers])
        return _Together(base, sharers, sinfo, prime_n, answers, srv.health_state(), srv.client.props())


def check_share_hit(servers: _Servers) -> CheckResult:
    """Sharers hit one pool together, and each is exact against the reference's own-cache answer.

    Two phases.  *Together*: one server, the pool primed once, all sharers sent at
    once; each must hit and process only ``n_prompt - P`` tokens, and each greedy one
    answer like it does alone in the next phase: :func:`~polykv_py.harness.compare.compare_greedy`
    with the :data:`~polykv_py.harness.compare.LAYOUT` margins (concurrent sharers' cells sit
    elsewhere, so rounding may differ), identical or a near tie (a seeded sampler turns such
    rounding into another token whenever its draw falls near a boundary: the sampled sharer is
    compared byte for byte in the next phase only).  *Exact*: for each
    sharer a fresh share server (prime the pool with the sharer's first P tokens, send the sharer) and a
    fresh reference server (prime slot s with the same tokens, send the same request to slot s), so that both
    lay the request's KV cells out the same way: on this tree the CPU flash-attention
    kernel walks the cache in fixed tiles of cells, so where a cell sits changes the
    rounding, and only like-for-like layouts can be compared byte for byte.
    """
    cfg = servers.cfg
    res = CheckResult("share_hit")
    kind = cfg.share_server
    args = [*_base_args(cfg), no_clear_idle_flag(servers.binary(kind))]
    ref_args = [*_base_args(cfg), NO_CACHE_IDLE]
    res.info = {"share_server": kind, "flags": args, "reference_flags": ref_args}
    together, together_cases = _share_hit_together(servers, kind, args, res)
    alone = _share_hit_alone(servers, kind, args, ref_args, together, res)
    verdicts = _together_vs_alone(together, together_cases, alone)
    res.info["together"]["vs_alone"] = {v: verdicts.count(v) for v in (*COMPARE_VERDICTS, NOT_COMPARED)} | {
        "max_drift": max((d for tc in together_cases if (d := tc["vs_alone_max_drift"]) is not None), default=0.0)
    }
    _share_hit_summary(res, kind, together, together_cases, verdicts)
    return res


def _share_hit_together(
    servers: _Servers, kind: str, args: list[str], res: CheckResult
) -> tuple[_Together, list[Json]]:
    """Phase 1 of :func:`check_share_hit`: all sharers on one pool, at once; each must hit."""
    together = _together(servers, kind, args, f"share-{kind}-together")
    res.info.update(together.sharers_info)
    res.info["pool_prime_prompt_n"] = together.prime_prompt_n
    cases = []
    for s in together.sharers:
        ok, why, got = _sharer_verdict(together.final(s), s, "hit")
        cases.append({"name": s.case.name, "ok": ok, "status_ok": ok, "status_check": why, **got})
        log.info("  together %s: %s", s.case.name, why)
    res.info["together"] = {"n_sharers": len(together.sharers), "health_after": together.health, "cases": cases}
    return together, cases


def _share_hit_alone(
    servers: _Servers, kind: str, args: list[str], ref_args: list[str], together: _Together, res: CheckResult
) -> dict[int, Json]:
    """Phase 2 of :func:`check_share_hit`: each sharer alone against the reference, like for like (a fresh
    pair of servers each); adds a case per sharer to ``res``, returns each sharer's answer alone."""
    cfg = servers.cfg
    alone: dict[int, Json] = {}
    for s in together.sharers:
        with servers.start(kind, args, f"share-{kind}-{s.index}") as srv:
            srv.client.prime(s.prefix_tokens, POOL_SLOT)
            mine_raw = send(srv.client, s.with_pool())
            mine_fresh = final_of(send(srv.client, s.fresh()), "/completion") if cfg.fresh_info else {}
        with servers.start("upstream", ref_args, f"share-reference-{s.index}") as ref:
            ref.client.prime(s.prefix_tokens, s.slot)
            own_raw = send(ref.client, s.case)
            ref_fresh = final_of(send(ref.client, s.fresh()), "/completion") if cfg.fresh_info else {}
        mine, own = final_of(mine_raw, "/completion"), final_of(own_raw, "/completion")
        alone[s.index] = mine
        case = _sharer_case(s, _sharer_verdict(mine, s, "hit"), mine_raw, own_raw, "identical_to_reference_own_cache")
        info = {
            "share_server_first_token_max_logprob_diff": first_token_logprob_diff(mine, mine_fresh),
            "share_server_text_equal": mine.get("content") == mine_fresh.get("content"),
            "reference_first_token_max_logprob_diff": first_token_logprob_diff(own, ref_fresh),
            "reference_text_equal": own.get("content") == ref_fresh.get("content"),
            "together_phase_text_equal": mine.get("content") == together.final(s).get("content"),
        }
        res.cases.append({**case, "text": mine.get("content"), "info_vs_fresh_one_pass": info})
        log.info("  exact %s: P=%d n_prompt=%d -> %s; vs reference own cache: %s", s.case.name, s.p, s.n_prompt,
                 case["status_check"], _sameness(case))  # fmt: skip
        log.info(
            "    (info) fresh one-pass vs cached answer, max first-token |dlogprob|: share server %s, reference %s",
            info["share_server_first_token_max_logprob_diff"],
            info["reference_first_token_max_logprob_diff"],
        )
    return alone


def _together_vs_alone(together: _Together, cases: list[Json], alone: dict[int, Json]) -> list[str]:
    """The together phase's greedy answers against each sharer's answer alone (layout margins); the verdicts."""
    for s, tc in zip(together.sharers, cases, strict=True):
        if s.body.get("temperature"):
            # a seeded draw near a boundary of the cumulative distribution picks another token when the
            # probabilities move by layout rounding, so a sampled answer is compared byte for byte only in the
            # same layout (phase 2), not here
            tc.update(vs_alone=NOT_COMPARED, vs_alone_max_drift=None, vs_alone_detail="sampled: not compared")
            continue
        cmp = compare_greedy(alone[s.index], together.final(s), margins=LAYOUT)
        tc.update(vs_alone=cmp.verdict, vs_alone_max_drift=round(cmp.max_drift, 4), vs_alone_detail=cmp.detail)
        tc["ok"] = tc["status_ok"] and cmp.ok
        log.info("  together %s vs alone: %s (%s)", s.case.name, cmp.verdict, cmp.detail)
    return [tc["vs_alone"] for tc in cases]


def _share_hit_summary(
    res: CheckResult, kind: str, together: _Together, together_cases: list[Json], verdicts: list[str]
) -> None:
    """Set ``res.ok`` and its one-line summary: the first failure found, or what passed."""
    sharers, health = together.sharers, together.health
    bad_together = [c for c in together_cases if not c["ok"]]
    bad = [c for c in res.cases if not c["ok"]]
    res.ok = not bad and not bad_together and health == "ok"
    if bad_together:
        first = bad_together[0]
        why = (
            first["status_check"]
            if not first["status_ok"]
            else f"answer differs from alone: {first['vs_alone_detail']}"
        )
        res.summary = f"{len(bad_together)}/{len(sharers)} sharers failed on the shared pool; {first['name']}: {why}"
    elif health != "ok":
        res.summary = f"the {kind} server is {health} after the sharers"
    elif bad:
        res.summary = _failed_sharers(bad, len(res.cases), " against the reference")
    else:
        res.summary = (
            f"{len(sharers)} concurrent sharers hit one pool (P={[s.p for s in sharers]}), processed "
            f"only n_prompt - P tokens, and the greedy ones answered like each alone ({verdicts.count('identical')} "
            f"identical, {verdicts.count('near_tie')} near tie); each alone answered byte-identically to the "
            f"reference server's own-cache answer"
        )


def check_fallback_miss(servers: _Servers) -> CheckResult:
    """Without --no-clear-idle the pool is evicted: sharers miss, re-process, match the reference."""
    cfg = servers.cfg
    res = CheckResult("fallback_miss")
    args = _base_args(cfg)
    res.info = {"flags": args}
    with servers.start("patched", args, "fallback-patched") as srv:
        base = build_base(srv.client.prompt_tokens, cfg.base_tokens)
        sharers, sinfo = make_sharers(srv.client, base, cfg)
        res.info.update(sinfo)
        srv.client.prime(base, POOL_SLOT)
        answers, health = {}, []
        for s in sharers:
            answers[s.index] = send(srv.client, s.with_pool())
            health.append(srv.health_state())
        verdicts = {
            s.index: _sharer_verdict(final_of(answers[s.index], "/completion"), s, "not_resident") for s in sharers
        }
    with servers.start("upstream", args, "fallback-reference") as ref:
        ref.client.prime(base, POOL_SLOT)
        ref_answers = {s.index: send(ref.client, s.case) for s in sharers}
    res.info["health_after_each_sharer"] = health
    for s in sharers:
        case = _sharer_case(s, verdicts[s.index], answers[s.index], ref_answers[s.index], "identical_to_reference")
        res.cases.append(case)
        log.info("  %s: %s; vs reference: %s", s.case.name, case["status_check"], _sameness(case))
    bad = [c for c in res.cases if not c["ok"]]
    healthy = all(h == "ok" for h in health)
    res.ok = not bad and healthy
    if not healthy:
        res.summary = f"server not healthy after the sharers: {health}"
    elif bad:
        res.summary = _failed_sharers(bad, len(res.cases))
    else:
        res.summary = (
            f"pool evicted by idle-slot caching: {len(sharers)} sharers reported not_resident, re-processed "
            f"their full prompts, answered byte-identically to the reference; server healthy"
        )
    return res


def _auto_verdict(answer: Json, sharer: Sharer) -> tuple[bool, str, Json]:
    """A plain request on a --pool-auto server: a hit on the pool chosen and P computed by the server."""
    sp = answer.get("shared_prefix")
    prompt_n = (answer.get("timings") or {}).get("prompt_n")
    got = {"shared_prefix": sp, "prompt_n": prompt_n, "tokens_evaluated": answer.get("tokens_evaluated")}
    shared = min(sharer.p, sharer.n_prompt - 1)
    want = {"pool_slot": POOL_SLOT, "requested": None, "shared": shared, "status": "hit", "auto": "pool"}
    if sp != want:
        return False, f"shared_prefix is {sp}, expected {want} (a request with no pool field)", got
    if prompt_n != sharer.n_prompt - shared:
        return (
            False,
            f"processed {prompt_n} prompt tokens, expected n_prompt - shared = {sharer.n_prompt - shared}",
            got,
        )
    return True, f"automatic hit, shared {shared}, processed {prompt_n}", got


def check_auto_share(servers: _Servers) -> CheckResult:
    """``--pool-auto``: requests with no pool field, not pinned, share the reserved pool by themselves.

    For each sharer a fresh patched server (``--pool-slots 0 --pool-auto``, the pool primed) gets the
    sharer's request with no pool field and no ``id_slot``; it must hit pool 0 with ``"auto": "pool"``,
    P the common prefix of the tokenized prompts, and process only the rest. Its answer must be
    byte-identical to a fresh reference server's answer from its own cache after the same priming
    (slot s primed, the same request pinned to s: the same split and cell layout; both primed with the
    sharer's first P tokens, :attr:`Sharer.prefix_tokens`).
    """
    cfg = servers.cfg
    res = CheckResult("auto_share")
    args = [*_base_args(cfg), no_clear_idle_flag(servers.binary("patched")), "--pool-slots", str(POOL_SLOT),
            "--pool-auto"]  # fmt: skip
    ref_args = [*_base_args(cfg), NO_CACHE_IDLE]
    res.info = {"flags": args, "reference_flags": ref_args}
    for i in range(cfg.n_sharers):
        with servers.start("patched", args, f"auto-share-{i + 1}") as srv:
            if i == 0:
                base = build_base(srv.client.prompt_tokens, cfg.base_tokens)
                sharers, sinfo = make_sharers(srv.client, base, cfg)
                res.info.update(sinfo)
            s = sharers[i]
            srv.client.prime(s.prefix_tokens, POOL_SLOT)
            plain = {k: v for k, v in s.body.items() if k != "id_slot"}
            mine_raw = send(srv.client, Case(s.case.name + "/auto", "/completion", plain))
        mine = final_of(mine_raw, "/completion")
        slot = mine.get("id_slot", s.slot)
        with servers.start("upstream", ref_args, f"auto-reference-{i + 1}") as ref:
            ref.client.prime(s.prefix_tokens, slot)
            own_raw = send(ref.client, Case(s.case.name, "/completion", {**s.body, "id_slot": slot}))
        case = _sharer_case(s, _auto_verdict(mine, s), mine_raw, own_raw, "identical_to_reference_own_cache")
        res.cases.append(case)
        log.info("  %s: %s; vs reference own cache: %s", s.case.name, case["status_check"], _sameness(case))
    bad = [c for c in res.cases if not c["ok"]]
    res.ok = bool(res.cases) and not bad
    res.summary = (
        _failed_sharers(bad, len(res.cases))
        if bad
        else f"{len(res.cases)} plain requests (no pool field, not pinned) shared the pool by themselves "
        f"(auto 'pool', P={[c['P'] for c in res.cases]}) and answered byte-identically to the reference's own cache"
    )
    return res


def check_shared_decode(servers: _Servers) -> CheckResult:
    """``--shared-decode`` (patch 0076), a reporting run: the share_hit sharers at once, with it on and off.

    The other checks run with the option off. Here two patched servers that differ only in
    ``--shared-decode`` answer the sharers together (one decode batch of the sharers' rows over the
    pool's cells); each greedy answer with it on is compared with the same answer with it off
    (:data:`~polykv_py.harness.compare.LAYOUT` margins: the path rounds differently, like another cell
    layout). The check fails only on ``different``, or if the path did not run at all.
    """
    cfg = servers.cfg
    res = CheckResult("shared_decode")
    args = [*_base_args(cfg), no_clear_idle_flag(servers.binary("patched"))]
    res.info = {"flags": args, "on_flag": "--shared-decode"}
    off = _together(servers, "patched", args, "shared-decode-off")
    on = _together(servers, "patched", [*args, "--shared-decode"], "shared-decode-on")
    stats = on.props.get("polykv_shared_decode") or {}
    res.info["server_counters"] = stats
    for s in off.sharers:
        a, b = off.final(s), on.final(s)
        status_ok = (b.get("shared_prefix") or {}).get("status") == "hit"
        if s.body.get("temperature"):
            res.cases.append({"name": s.case.name, "ok": status_ok, "verdict": NOT_COMPARED})
            continue
        cmp = compare_greedy(a, b, margins=LAYOUT)
        res.cases.append({"name": s.case.name, "ok": status_ok and cmp.ok, "verdict": cmp.verdict,
                          "max_drift": round(cmp.max_drift, 4), "detail": cmp.detail})  # fmt: skip
        log.info("  %s on vs off: %s (%s)", s.case.name, cmp.verdict, cmp.detail)
    verdicts = [c["verdict"] for c in res.cases]
    ran = int(stats.get("ops", 0)) > 0
    res.ok = ran and all(c["ok"] for c in res.cases)
    counts = ", ".join(f"{verdicts.count(v)} {v}" for v in (*COMPARE_VERDICTS, NOT_COMPARED) if verdicts.count(v))
    res.summary = (
        f"sharers with --shared-decode vs without: {counts}; the path computed {stats.get('ops', 0)} attention ops"
        if ran
        else "the shared-decode path did not run (/props polykv_shared_decode: " + json.dumps(stats) + ")"
    )
    return res


#: Words whose first token may end the leader's prompt in :func:`check_share_any`'s exact phase (the first
#: one no sharer has at that position).
LEADER_WORDS = ("Summary", "Note", "Context", "Reply")
#: The tenant of :func:`check_share_any`'s salted request (the other requests carry no salt).
OTHER_SALT = "gate-other-tenant"
#: What a plain request leaves to the server (the reference answers in the slot it was sent to): not compared.
SERVER_PICKS = ("id_slot",)


def _plain(body: Json) -> Json:
    """A sharer's body as a plain client sends it: no pool field, not pinned to a slot."""
    return {k: v for k, v in body.items() if k != "id_slot"}


def _any_verdict(answer: Json, n_prompt: int, p: int) -> tuple[bool, str, Json]:
    """A plain request on a ``--share-any`` server: a hit on the computed prefix, exactly ``min(p, n_prompt - 1)``."""
    sp = answer.get("shared_prefix") or {}
    prompt_n = (answer.get("timings") or {}).get("prompt_n")
    got = {"shared_prefix": answer.get("shared_prefix"), "prompt_n": prompt_n}
    shared = min(p, n_prompt - 1)
    if sp.get("status") != "hit" or sp.get("auto") != "any" or sp.get("shared") != shared:
        return False, f"shared_prefix is {answer.get('shared_prefix')}, expected an 'any' hit sharing {shared}", got
    if prompt_n != n_prompt - shared:
        return False, f"processed {prompt_n} prompt tokens, expected n_prompt - shared = {n_prompt - shared}", got
    return True, f"hit (any), shared {shared}, processed {prompt_n}", got


def _leader_tokens(client: Client, base: str, sharers: list[Sharer]) -> list[int]:
    """The exact phase's leader prompt, as tokens: the prefix every sharer's prompt has in common with the base,
    then one token no sharer has there; each sharer's P (set here) is that prefix.

    One token and not more: the other token keeps the sharer from being routed into the leader's slot, and the
    reference can hold it in a cell of its own between the prefix and the suffix (:func:`_prime_like_the_leader`).
    A leader with a whole question of its own left a hole the reference filled with its first generated token,
    and the answers differed from the second token on while the prompts' cells matched.
    """
    base_tokens = client.prompt_tokens(base)
    prompts = [s.tokens for s in sharers]
    p = min(common_prefix_len(base_tokens, t) for t in prompts)
    taken = {t[p] for t in prompts if len(t) > p}
    extra = next(tok for word in LEADER_WORDS for tok in client.tokenize(word)[:1] if tok not in taken)
    for s in sharers:
        s.p = p
    return [*base_tokens[:p], extra]


def _prime_like_the_leader(client: Client, leader: list[int], slot: int) -> None:
    """The reference's cells as the patched server holds them when a sharer arrives after ``leader``.

    There the leader's slot keeps all its cells: the common prefix (cells 0..P-1, shared with the sharer) and its
    one other token (cell P), so the sharer's suffix starts at cell P+1. The reference gets the prefix in ``slot``
    and then the other token alone in another slot (cell P, moving the cell search past it); the sharer, sent
    to ``slot``, keeps its P cells and puts its suffix from cell P+1 on too. (Priming ``slot`` with the whole
    leader would free cell P for the suffix: a one-cell shift that the CPU's attention never showed, but that
    Vulkan's reductions do, in the last bits.) The other token's cell is masked for the sharer either way.
    """
    client.prime(leader[:-1], slot)
    client.prime(leader[-1:], 0 if slot else 1)


def _share_any_args(cfg: GateConfig, *, shared_decode: bool) -> list[str]:
    """``polykv serve``'s recipe (one reserved slot for promotions, ``--share-any``) at the gate's size."""
    return [*serve_args(0, agent_slots=n_slots(cfg) - 1, ctx=cfg.ctx, shared_decode=shared_decode),
            "--metrics"]  # fmt: skip


def _share_any_together(servers: _Servers, base: str, sharers: list[Sharer], res: CheckResult) -> dict[int, Json]:
    """Phase 1 of :func:`check_share_any`: every sharer at once, plain, with shared decode on as ``polykv serve``
    runs it; the prompt tokens computed (``/metrics``) at most the common prefix plus each sharer's suffix."""
    cfg = servers.cfg
    with servers.start("patched", _share_any_args(cfg, shared_decode=True), "share-any-together") as srv:
        before = srv.client.metrics().get("llamacpp:prompt_tokens_total", 0.0)
        cases = [Case(s.case.name + "/plain", "/completion", _plain(s.body), group=1) for s in sharers]
        answers = run_cases(srv, cases)
        computed = srv.client.metrics().get("llamacpp:prompt_tokens_total", 0.0) - before
        health = srv.health_state()
    finals = {s.index: final_of(answers[c.name], "/completion") for s, c in zip(sharers, cases, strict=True)}
    p_all = min(s.p for s in sharers)  # the prefix every prompt has in common with the base
    bound = p_all + sum(s.n_prompt - p_all for s in sharers)
    statuses = {s.index: (finals[s.index].get("shared_prefix") or {}).get("status") for s in sharers}
    n_hits = sum(st == "hit" for st in statuses.values())
    cases_info = []
    ok = health == "ok" and computed <= bound and n_hits == len(sharers) - 1
    for s in sharers:
        final = finals[s.index]
        shared = (final.get("shared_prefix") or {}).get("shared", 0) if statuses[s.index] == "hit" else 0
        prompt_n = (final.get("timings") or {}).get("prompt_n")
        consistent = prompt_n == s.n_prompt - shared and (
            statuses[s.index] != "hit" or shared >= min(s.p, s.n_prompt - 1)
        )
        ok = ok and consistent
        cases_info.append({"name": s.case.name, "status": statuses[s.index], "shared": shared, "prompt_n": prompt_n,
                           "n_prompt": s.n_prompt, "P": s.p, "consistent": consistent})  # fmt: skip
    res.info["together"] = {"prompt_tokens_computed": computed, "bound_P_plus_suffixes": bound, "hits": n_hits,
                            "health_after": health, "cases": cases_info, "ok": ok}  # fmt: skip
    log.info("  together: %d/%d shared, %d prompt tokens computed (bound P + suffixes = %d), server %s",
             n_hits, len(sharers), int(computed), bound, health)  # fmt: skip
    return finals if ok else {}


def _other_salt(servers: _Servers, s: Sharer, leader: list[int], args: list[str], ref_args: list[str]) -> Json:
    """Sharer ``s``'s prompt under :data:`OTHER_SALT` after an unsalted leader: nothing shared, the whole prompt
    processed, and the answer the reference gives for the prompt in a slot of its own after the same leader."""
    with servers.start("patched", args, "share-any-other-salt") as srv:
        srv.client.prime(leader, None)
        mine_raw = send(srv.client, Case("salted", "/completion", {**_plain(s.body), "cache_salt": OTHER_SALT}))
    with servers.start("upstream", ref_args, "share-any-other-salt-reference") as ref:
        ref.client.prime(leader, s.slot)
        ref_raw = send(ref.client, Case("salted", "/completion", {**s.body, "id_slot": s.slot + 1}))
    mine = final_of(mine_raw, "/completion")
    prompt_n = (mine.get("timings") or {}).get("prompt_n")
    same, diff = compare(mine_raw, ref_raw, (*VOLATILE_FIELDS, *SHARE_FIELDS, *SERVER_PICKS),
                         (*VOLATILE_FIELDS, *SERVER_PICKS))  # fmt: skip
    ok = "shared_prefix" not in mine and prompt_n == s.n_prompt and same
    log.info("  other salt: shared_prefix %s, processed %s of %d; vs reference: %s",
             mine.get("shared_prefix"), prompt_n, s.n_prompt, _sameness({"difference": diff}))  # fmt: skip
    return {"name": f"{s.case.name}/cache_salt={OTHER_SALT}", "ok": ok, "prompt_n": prompt_n,
            "shared_prefix": mine.get("shared_prefix"), "identical_to_reference": same, "difference": diff}  # fmt: skip


def check_share_any(servers: _Servers) -> CheckResult:
    """Zero-config sharing (``--share-any``, as ``polykv serve`` runs it): plain requests, no pool, no slot.

    *Together*: every sharer at once on one server with shared decode on; all but the first must share (an
    ``any`` hit), each process only its prompt minus what it shared, the server compute at most the common
    prefix plus each sharer's suffix (``llamacpp:prompt_tokens_total``), and each greedy answer match its
    exact-phase answer under the :data:`~polykv_py.harness.compare.LAYOUT` margins.
    *Exact* (shared decode off, one sharer at a time): per sharer a fresh server gets a leader (the prefix the
    sharers have in common with the base and one other token, nothing generated: :func:`_leader_tokens`), then
    the sharer, plain: it must share exactly its common prefix with the leader's prompt and answer
    byte-identically to a fresh reference server that holds the same cells in the same places
    (:func:`_prime_like_the_leader`) and gets the sharer in the slot holding the prefix (its own cache).
    One more pair of servers: after the same leader, the first sharer's prompt under another ``cache_salt`` must
    share nothing, process its whole prompt and answer as the reference does (there: in another slot;
    :func:`_other_salt`).
    """
    cfg = servers.cfg
    res = CheckResult("share_any")
    ref_args = [*slots_args(n_slots(cfg), cfg.ctx), UNIFIED_KV, NO_CACHE_IDLE, *NO_HOST_CACHE]
    res.info = {"flags_together": _share_any_args(cfg, shared_decode=True),
                "flags_exact": _share_any_args(cfg, shared_decode=False), "reference_flags": ref_args}  # fmt: skip

    exact_cases: list[Json] = []
    exact: dict[int, Json] = {}
    sharers: list[Sharer] = []
    base = ""
    leader: list[int] = []
    for i in range(cfg.n_sharers):
        with servers.start("patched", res.info["flags_exact"], f"share-any-exact-{i + 1}") as srv:
            if i == 0:
                base = build_base(srv.client.prompt_tokens, cfg.base_tokens)
                sharers, sinfo = make_sharers(srv.client, base, cfg)
                leader = _leader_tokens(srv.client, base, sharers)
                res.info.update(sinfo, leader_tokens=len(leader), p_with_leader=[s.p for s in sharers])
            s = sharers[i]
            srv.client.prime(leader, None)
            mine_raw = send(srv.client, Case(s.case.name + "/plain", "/completion", _plain(s.body)))
        with servers.start("upstream", ref_args, f"share-any-reference-{i + 1}") as ref:
            _prime_like_the_leader(ref.client, leader, s.slot)
            own_raw = send(ref.client, s.case)
        exact[s.index] = final_of(mine_raw, "/completion")
        case = _sharer_case(s, _any_verdict(exact[s.index], s.n_prompt, s.p), mine_raw, own_raw,
                            "identical_to_reference", SERVER_PICKS)  # fmt: skip
        exact_cases.append(case)
        log.info("  exact %s: %s; vs reference own cache: %s", s.case.name, case["status_check"], _sameness(case))
    exact_cases.append(_other_salt(servers, sharers[0], leader, res.info["flags_exact"], ref_args))
    res.cases = exact_cases

    together = _share_any_together(servers, base, sharers, res)
    vs_exact = []
    for s in sharers:
        if not together or s.body.get("temperature"):
            continue
        cmp = compare_greedy(exact[s.index], together[s.index], margins=LAYOUT)
        vs_exact.append({"name": s.case.name, "verdict": cmp.verdict, "max_drift": round(cmp.max_drift, 4),
                         "detail": cmp.detail, "ok": cmp.ok})  # fmt: skip
        log.info("  together %s vs exact: %s (%s)", s.case.name, cmp.verdict, cmp.detail)
    res.info["together_vs_exact"] = vs_exact

    bad = [c for c in exact_cases if not c["ok"]]
    bad_vs = [c for c in vs_exact if not c["ok"]]
    res.ok = bool(together) and not bad and not bad_vs
    t = res.info["together"]
    failures = []
    if bad:
        first = bad[0]
        why = (
            first.get("status_check") if not first.get("status_ok", True) else f"output differs: {first['difference']}"
        )
        failures.append(f"{len(bad)}/{len(exact_cases)} exact cases failed; {first['name']}: {why}")
    if not together:
        failures.append(f"together: {t['hits']}/{len(sharers)} shared, {int(t['prompt_tokens_computed'])} prompt "
                        f"tokens computed (bound {t['bound_P_plus_suffixes']}), server {t['health_after']}; "
                        f"{[c for c in t['cases'] if not c['consistent']] or t['cases']}")  # fmt: skip
    if bad_vs:
        failures.append(f"a concurrent answer differs from its exact one: {bad_vs}")
    res.summary = (
        " | ".join(failures)
        if failures
        else f"{len(sharers)} plain requests at once: {t['hits']} shared, {int(t['prompt_tokens_computed'])} prompt "
        f"tokens computed (<= P + suffixes = {t['bound_P_plus_suffixes']}); one at a time each shared exactly its "
        f"prefix with the leader (P={[s.p for s in sharers]}) and answered byte-identically to the reference's own "
        f"cache; another cache_salt shared nothing and answered as the reference"
    )
    return res


_CHECK_FUNCS: dict[str, Callable[[_Servers], CheckResult]] = {
    "default_output": check_default_output,
    "share_hit": check_share_hit,
    "fallback_miss": check_fallback_miss,
    "auto_share": check_auto_share,
    "shared_decode": check_shared_decode,
    "share_any": check_share_any,
}


def run_gate(cfg: GateConfig | None = None) -> Json:
    """Run the configured checks and return the report (``report["ok"]`` is the verdict)."""
    cfg = cfg or GateConfig()
    t0 = time.monotonic()
    servers = _Servers(cfg)
    report: Json = {
        "ok": False,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "model": str(servers.model),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "volatile_fields": list(VOLATILE_FIELDS),
        "share_fields": list(SHARE_FIELDS),
        "checks": {},
    }
    for name in cfg.checks:
        if name not in _CHECK_FUNCS:
            raise ValueError(f"unknown check {name!r}; choose from {CHECKS}")
        log.info("== %s", name)
        t = time.monotonic()
        try:
            result = _CHECK_FUNCS[name](servers)
        except PolykvError as exc:
            result = CheckResult(name, ok=False, summary=f"could not run: {exc}")
        result.duration_s = round(time.monotonic() - t, 1)
        log.info("== %s: %s: %s (%.0fs)", name, "PASS" if result.ok else "FAIL", result.summary, result.duration_s)
        report["checks"][name] = asdict(result)
    report["binaries"] = {k: str(v) for k, v in servers.bins.items()}
    report["ok"] = all(c["ok"] for c in report["checks"].values()) and bool(report["checks"])
    report["duration_s"] = round(time.monotonic() - t0, 1)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polykv gate", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The gate's options (shared by ``polykv gate`` and ``gate/run_gate.py``)."""
    p.add_argument("--report", type=Path, help="write the JSON report here")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument(
        "--share-server",
        choices=("patched", "upstream"),
        default="patched",
        help="server the share check runs on (upstream: a negative control that must FAIL)",
    )
    p.add_argument("--model", type=Path, help="GGUF (default: the pinned default model)")
    p.add_argument("--patched-bin", type=Path)
    p.add_argument("--upstream-bin", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--n-predict", type=int, default=16)
    p.add_argument("--base-tokens", type=int, default=1200)
    p.add_argument("--sharers", type=int, default=3)
    p.add_argument("--log-dir", type=Path, help="server logs (default: a temporary directory)")
    p.add_argument(
        "--server-args",
        default="",
        metavar="ARGS",
        help="arguments added to every server the gate starts, patched and reference alike, split as a shell "
        "would (e.g. --server-args='-ngl 99' to offload the layers to a GPU backend)",
    )
    p.add_argument(
        "--skip-fresh-info",
        action="store_true",
        help="do not measure the informational fresh one-pass answers (saves two prefills per sharer)",
    )
    p.add_argument("-q", "--quiet", action="store_true")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the gate from the command line: 0 all checks passed, 1 a check failed."""
    return run_from_args(build_parser().parse_args(argv))


def run_from_args(args: argparse.Namespace) -> int:
    """Run the gate for parsed arguments: 0 all checks passed, 1 a check failed."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    log.setLevel(logging.WARNING if args.quiet else logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    same_name = ("model", "patched_bin", "upstream_bin", "threads", "ctx", "n_predict", "base_tokens", "log_dir")
    cfg = GateConfig(
        **{name: getattr(args, name) for name in same_name},
        share_server=ServerKind.of(args.share_server),
        checks=tuple(c for c in args.checks.split(",") if c),
        n_sharers=args.sharers,
        fresh_info=not args.skip_fresh_info,
        server_args=tuple(shlex.split(args.server_args)),
    )
    try:
        report = run_gate(cfg)
    except (PolykvError, ValueError) as exc:
        log.error("gate could not run: %s", exc)
        report = {"ok": False, "error": str(exc), "checks": {}}
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    out = sys.stdout  # the verdict, for the terminal and CI (the progress went through logging)
    for name, check in report["checks"].items():
        out.write(f"{'PASS' if check['ok'] else 'FAIL'}  {name}: {check['summary']}\n")
    out.write(
        f"gate {'PASSED' if report['ok'] else 'FAILED'}" + (f"; report: {args.report}" if args.report else "") + "\n"
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

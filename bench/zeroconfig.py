"""Zero-config sharing (issue 24): plain OpenAI chat requests on ``polykv serve`` against the stock server.

N agents send ordinary chat requests through the official ``openai`` package, all at once: a system
message of about P tokens (the sample design document, package data, repeated and cut with the
server's tokenizer) and a question each; greedy (temperature 0), G tokens, 5 log-probabilities per
token. No request names a pool, a slot or a prefix length. Turn 2 sends each agent's whole history
(system, question, the answer, a new question), again all at once.

The systems, each on a fresh server with N agent slots and the same KV cells (``--ctx``):

- ``polykv``: the patched server as ``polykv serve`` starts it without ``--pool``
  (:func:`polykv_py.presets.serve_server` with no pool: ``--share-any`` and ``--shared-decode`` on,
  slot 0 reserved and left empty, N more slots): a request shares the longest prefix any other slot
  has computed, and requests with a common prefix wait for the one computing it;
- ``stock``: the pristine llama-server (:func:`polykv_py.presets.reference_server`: unified KV, idle
  slots kept resident, no host prompt cache), N slots.

Both systems get the same turn-2 histories: the answers in them are the first system's turn-1
answers (``polykv`` runs first), so the answers of the two systems can be compared token by token
(:func:`polykv_py.harness.compare.compare_steps`, layout margins).

Per turn and system the report gives the wall time, the prompt tokens the server computed (the
``llamacpp:prompt_tokens_total`` delta of ``/metrics``), the lower bounds a perfect prefix cache
would reach (see :data:`DEFINITIONS`), the share statuses and the requests that were served the
turn's common prefix from cache. Writes ``bench/results/zeroconfig/<tag>.json``, ``.md`` and, with
matplotlib, ``.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import openai

from polykv_py.data import sample_document
from polykv_py.data.questions import QUESTIONS
from polykv_py.errors import PolykvError
from polykv_py.harness.compare import LAYOUT, compare_steps, steps_from_probs
from polykv_py.harness.report import table
from polykv_py.harness.texts import repeat_to_tokens
from polykv_py.jsontypes import Json
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import reference_server, serve_server
from polykv_py.tokens import longest_common_prefix

from . import RESULTS
from .machine import load_avg, machine

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

log = logging.getLogger(__name__)

Message = dict[str, str]

#: The systems, in the order they run (the first one's turn-1 answers go into every turn-2 history).
SYSTEMS: dict[str, str] = {
    "polykv": "polykv serve without --pool (--share-any, --shared-decode; slot 0 reserved, N agent slots)",
    "stock": "stock llama-server (-kvu, idle slots resident, no host cache), N slots",
    "stock_queued": "stock llama-server, 1 slot: the requests queue and each reuses the previous one's cached prefix "
    "(its own prefix reuse at its best for one shared system message)",
}
#: The stock systems (each compared with polykv; the fastest per turn is "best stock").
STOCK = ("stock", "stock_queued")
TURNS = 2
#: The metric whose delta is "prompt tokens computed".
PROMPT_METRIC = "llamacpp:prompt_tokens_total"
#: The other counters the report keeps (the patched server's; absent on the stock one).
SHARE_METRICS = ("llamacpp:polykv_share_any_total", "llamacpp:polykv_share_waits_total")
#: Template and question tokens a turn adds per agent at most (for the KV check; measured: under 40).
TURN_OVERHEAD = 64

#: What the report's fields mean (written into the JSON and the markdown).
DEFINITIONS: dict[str, str] = {
    "wall_s": "seconds from sending the turn's first request to receiving its last answer (all N in flight)",
    "prompt_tokens_computed": f"delta of {PROMPT_METRIC} on /metrics across the turn: prompt tokens the server "
    "evaluated (cached or shared tokens are not counted)",
    "prompt_tokens_sent": "sum of usage.prompt_tokens over the turn's requests",
    "common_prefix_tokens": "C: the longest token prefix all N rendered prompts of the turn share (system message "
    "and template; prompts rendered by /apply-template, tokenized by /tokenize on the same server)",
    "bound_tokens": "tokens a perfect prefix cache starting the turn empty must compute: the number of distinct "
    "token prefixes of the turn's N prompts (nodes of their token trie); C + sum(n_i - C) when the prompts part "
    "right after C",
    "bound_resident_tokens": "the same, with every sequence the previous turn left in this server's KV reused for "
    "free (each agent's previous prompt plus the token ids this server generated for it, but the last): what a "
    "server that keeps every slot resident and shares any prefix must compute; equals bound_tokens on turn 1",
    "cached_ge_common": "requests whose usage.prompt_tokens_details.cached_tokens >= C (got the common prefix "
    "without computing it; on turn 1 all but one is the most a system can reach)",
    "statuses": "shared_prefix.status counts (the patched server's report; none for the stock server)",
    "waited": "requests whose shared_prefix says waited: true (coalesced behind another slot's prefill)",
    "prompt_token_mismatches": "requests whose usage.prompt_tokens differs from the tokenized rendered prompt "
    "(0 means the bounds count the tokens the server saw)",
    "ratios": "stock / polykv, per turn and over both turns: wall time and prompt tokens computed",
    "answers": "per agent, compare_steps(polykv, stock) over the log-probabilities (LAYOUT margins: drift 0.5 per "
    "token, a flip only between near ties within 1.0): identical / near_tie / different",
}


@dataclass(frozen=True)
class ZeroConfig:
    """One run: N agents, a P-token system message, G greedy tokens per answer, two turns."""

    n: int = 8
    prompt_tokens: int = 2000
    max_tokens: int = 16
    ctx: int = 32768
    threads: int = 2
    systems: tuple[str, ...] = tuple(SYSTEMS)
    tag: str = ""
    model: str | None = None
    out_dir: Path = RESULTS / "zeroconfig"
    timeout: float = 3600.0
    top_logprobs: int = 5

    @property
    def name(self) -> str:
        """The report's file stem: ``tag``, else ``n{N}-p{P}-g{G}``."""
        return self.tag or f"n{self.n}-p{self.prompt_tokens}-g{self.max_tokens}"


@dataclass
class SystemRun:
    """What one system's run leaves for the report and for the next system."""

    system: str
    system_text: str = ""
    answers: list[list[str]] = field(default_factory=list)  # [agent][turn]: this system's own answers
    turns: list[Json] = field(default_factory=list)
    server_args: list[str] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> Json:
        """The report's record of this system (answers and requests inside ``turns``)."""
        out: Json = {"system": self.system, "label": SYSTEMS[self.system], "server_args": self.server_args}
        if self.error:
            out["error"] = self.error
        out["turns"] = self.turns
        return out


# --------------------------------------------------------------------------- inputs
def question(agent: int, turn: int) -> str:
    """Agent ``agent``'s question at turn ``turn`` (0-based; cycles through the 32 questions)."""
    return QUESTIONS[(agent * 7 + turn) % len(QUESTIONS)][0]


def messages(system_text: str, agent: int, turn: int, history: Sequence[str]) -> list[Message]:
    """The chat of ``agent`` at ``turn``: the system message, its questions, and ``history[k]``, its answer at
    turn ``k``, for every earlier turn."""
    chat = [{"role": "system", "content": system_text}]
    for k in range(turn):
        chat += [{"role": "user", "content": question(agent, k)}, {"role": "assistant", "content": history[k]}]
    chat.append({"role": "user", "content": question(agent, turn)})
    return chat


def system_message(server: LlamaServer, target_tokens: int) -> str:
    """A system message of ``target_tokens`` tokens: the sample document repeated and cut (server tokenizer)."""
    c = server.client
    return repeat_to_tokens(sample_document(), target_tokens, c.tokenize, c.detokenize)


def rendered_tokens(server: LlamaServer, chat: list[Message]) -> list[int]:
    """The tokens of ``chat`` as the server renders it (``/apply-template``) and tokenizes it."""
    c = server.client
    return c.prompt_tokens(c.apply_template(cast("list[Json]", chat)))


def trie_tokens(prompts: Sequence[Sequence[int]], resident: Sequence[Sequence[int]] = ()) -> int:
    """Distinct token prefixes of ``prompts`` that are not prefixes of a ``resident`` sequence: what a cache
    that computes each distinct prefix once, and has the ``resident`` ones already, must compute."""
    root: dict[int, Any] = {}

    def insert(seq: Sequence[int]) -> int:
        node, added = root, 0
        for t in seq:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                added += 1
            node = nxt
        return added

    for seq in resident:
        insert(seq)
    return sum(insert(p) for p in prompts)


def kv_cells_needed(system: str, cfg: ZeroConfig) -> int:
    """An upper estimate of the KV cells turn 2 needs: the stock server holds every agent's whole history;
    polykv the system message once plus every agent's own part."""
    own = TURNS * (TURN_OVERHEAD + cfg.max_tokens)
    if system == "stock":
        return cfg.n * (cfg.prompt_tokens + own)
    return cfg.prompt_tokens + cfg.n * own


# --------------------------------------------------------------------------- one request, one turn
def ask(client: openai.OpenAI, chat: list[Message], cfg: ZeroConfig) -> Json:
    """One chat request with the official client; what the report keeps of it."""
    t0 = time.perf_counter()
    try:
        resp = client.chat.completions.create(
            model="polykv",
            messages=cast("list[ChatCompletionMessageParam]", chat),
            temperature=0,
            max_tokens=cfg.max_tokens,
            logprobs=True,
            top_logprobs=cfg.top_logprobs,
        )
    except openai.OpenAIError as exc:
        return {"wall_s": round(time.perf_counter() - t0, 3), "error": f"{type(exc).__name__}: {exc}"[:400]}
    wall = time.perf_counter() - t0
    doc = resp.model_dump()  # keeps llama-server's own fields (shared_prefix, token ids)
    choice = doc["choices"][0]
    usage = doc.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "wall_s": round(wall, 3),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "shared_prefix": doc.get("shared_prefix"),
        "finish_reason": choice.get("finish_reason"),
        "content": (choice.get("message") or {}).get("content") or "",
        "logprobs": (choice.get("logprobs") or {}).get("content") or [],
    }


def answer_ids(req: Json) -> list[int]:
    """The generated token ids of a request (from its log-probabilities)."""
    return [int(e["id"]) for e in req.get("logprobs") or [] if "id" in e]


def run_turn(
    server: LlamaServer,
    client: openai.OpenAI,
    chats: list[list[Message]],
    prompts: list[list[int]],
    resident: list[list[int]],
    cfg: ZeroConfig,
) -> Json:
    """All N requests of one turn at once, with the metrics around them."""
    before = server.client.metrics()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(chats)) as pool:
        requests = list(pool.map(lambda chat: ask(client, chat, cfg), chats))
    wall = time.perf_counter() - t0
    time.sleep(0.3)  # the server's counters after the last answer
    after = server.client.metrics()
    delta = {k: after[k] - before.get(k, 0.0) for k in after if k.endswith("_total")}
    common = longest_common_prefix(prompts)
    ok = [r for r in requests if "error" not in r]
    statuses = Counter(str((r.get("shared_prefix") or {}).get("status", "none")) for r in ok)
    for i, (r, toks) in enumerate(zip(requests, prompts, strict=True)):
        r["agent"] = i
        r["rendered_tokens"] = len(toks)
    return {
        "wall_s": round(wall, 3),
        "prompt_tokens_computed": int(delta.get(PROMPT_METRIC, -1)),
        "prompt_tokens_sent": sum(int(r.get("prompt_tokens") or 0) for r in ok),
        "common_prefix_tokens": common,
        "bound_tokens": trie_tokens(prompts),
        "bound_resident_tokens": trie_tokens(prompts, resident),
        "cached_ge_common": sum(1 for r in ok if (r.get("cached_tokens") or 0) >= common),
        "statuses": dict(sorted(statuses.items())),
        "waited": sum(1 for r in ok if (r.get("shared_prefix") or {}).get("waited")),
        "prompt_token_mismatches": sum(1 for r in ok if r.get("prompt_tokens") != r["rendered_tokens"]),
        "share_metrics": {k.split(":", 1)[1]: int(delta[k]) for k in SHARE_METRICS if k in delta},
        "n_errors": len(requests) - len(ok),
        "errors": [r["error"] for r in requests if "error" in r][:3],
        "requests": requests,
    }


# --------------------------------------------------------------------------- one system
def start(system: str, cfg: ZeroConfig) -> LlamaServer:
    """A started server for ``system``: N agent slots, ``ctx`` KV cells."""
    if system == "polykv":
        srv = serve_server(
            0,
            agent_slots=cfg.n,
            ctx=cfg.ctx,
            threads=cfg.threads,
            share_any=True,
            shared_decode=True,
            model=cfg.model,
            name="zeroconfig-polykv",
        )
    elif system in STOCK:
        n_slots = cfg.n if system == "stock" else 1
        srv = reference_server(
            n_slots=n_slots, ctx=cfg.ctx, threads=cfg.threads, model=cfg.model, name=f"zeroconfig-{system}"
        )
    else:
        raise ValueError(f"unknown system {system!r} (known: {', '.join(SYSTEMS)})")
    return srv.start()


def run_system(system: str, cfg: ZeroConfig, system_text: str | None, history: list[list[str]] | None) -> SystemRun:
    """Both turns of ``system`` on a fresh server.

    ``system_text``: the system message (None: build it with this server's tokenizer); ``history[i][k]``:
    agent i's answer at turn k as later turns' chats carry it (None: this system's own answers).
    """
    run = SystemRun(system, answers=[[] for _ in range(cfg.n)])
    server = start(system, cfg)
    run.server_args = server.args
    try:
        run.system_text = system_text if system_text is not None else system_message(server, cfg.prompt_tokens)
        resident: list[list[int]] = []  # what the previous turn left in KV: prompt + answer but its last token
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=cfg.timeout)
        with client:
            for t in range(TURNS):
                hist = history if history is not None else run.answers
                chats = [messages(run.system_text, i, t, hist[i]) for i in range(cfg.n)]
                prompts = [rendered_tokens(server, chat) for chat in chats]
                log.info(
                    "zeroconfig: %s turn %d: %d agents, prompts of %d-%d tokens ...",
                    system,
                    t + 1,
                    cfg.n,
                    min(map(len, prompts)),
                    max(map(len, prompts)),
                )
                turn = {"turn": t + 1, **run_turn(server, client, chats, prompts, resident, cfg)}
                run.turns.append(turn)
                log.info(
                    "zeroconfig: %s turn %d: %.2f s, %d prompt tokens computed (bound %d, resident bound %d), "
                    "%d/%d with the common prefix cached, statuses %s, %d waited",
                    system,
                    t + 1,
                    turn["wall_s"],
                    turn["prompt_tokens_computed"],
                    turn["bound_tokens"],
                    turn["bound_resident_tokens"],
                    turn["cached_ge_common"],
                    cfg.n,
                    turn["statuses"],
                    turn["waited"],
                )
                for i, req in enumerate(turn["requests"]):
                    run.answers[i].append(str(req.get("content", "")))
                resident = [p + answer_ids(req)[:-1] for p, req in zip(prompts, turn["requests"], strict=True)]
    except (PolykvError, OSError) as exc:
        run.error = f"{type(exc).__name__}: {exc}"[:800]
        log.warning("zeroconfig: %s failed: %s", system, run.error)
    finally:
        server.stop()
    return run


# --------------------------------------------------------------------------- comparison and summary
def compare_turn(a: Json, b: Json) -> Json:
    """Per agent, ``a``'s answer against ``b``'s in one turn (layout margins); verdict counts."""
    agents: list[Json] = []
    for ra, rb in zip(a["requests"], b["requests"], strict=True):
        if "error" in ra or "error" in rb:
            agents.append({"agent": ra["agent"], "verdict": "error"})
            continue
        try:
            c = compare_steps(
                steps_from_probs(ra["logprobs"]),
                steps_from_probs(rb["logprobs"]),
                text_a=ra["content"],
                text_b=rb["content"],
                margins=LAYOUT,
            )
        except (KeyError, TypeError, ValueError) as exc:  # no token ids in the log-probabilities
            agents.append({"agent": ra["agent"], "verdict": "error", "detail": f"not comparable: {exc!r}"})
            continue
        agents.append(
            {
                "agent": ra["agent"],
                "verdict": c.verdict,
                "diverged_at": c.diverged_at,
                "max_drift": round(c.max_drift, 4),
                "detail": c.detail,
            }
        )
    counts = Counter(str(x["verdict"]) for x in agents)
    return {
        "verdicts": {v: counts.get(v, 0) for v in ("identical", "near_tie", "different", "error")},
        "agents": agents,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 or a < 0 else round(a / b, 3)


def summarize(runs: dict[str, Json]) -> Json:
    """Each stock system over polykv (``{stock system: {"per_turn": rows}}``), for those that ran."""
    return {name: c for name in STOCK if (c := summarize_pair(runs.get("polykv"), runs.get(name)))}


def summarize_pair(p: Json | None, s: Json | None) -> Json:
    """Stock over polykv per turn and over both turns, and the answers compared, when both ran."""
    if not p or not s or "error" in p or "error" in s or len(p["turns"]) != len(s["turns"]):
        return {}
    rows: list[Json] = []
    for tp, ts in zip(p["turns"], s["turns"], strict=True):
        rows.append(
            {
                "turn": tp["turn"],
                "wall_stock_over_polykv": _ratio(ts["wall_s"], tp["wall_s"]),
                "prompt_tokens_stock_over_polykv": _ratio(ts["prompt_tokens_computed"], tp["prompt_tokens_computed"]),
                "answers": compare_turn(tp, ts),
            }
        )
    total = {
        k: (sum(t[k] for t in p["turns"]), sum(t[k] for t in s["turns"])) for k in ("wall_s", "prompt_tokens_computed")
    }
    rows.append(
        {
            "turn": "total",
            "wall_stock_over_polykv": _ratio(total["wall_s"][1], total["wall_s"][0]),
            "prompt_tokens_stock_over_polykv": _ratio(
                total["prompt_tokens_computed"][1], total["prompt_tokens_computed"][0]
            ),
        }
    )
    return {"per_turn": rows}


# --------------------------------------------------------------------------- the run and its report
def run(cfg: ZeroConfig) -> Json:
    """Every system in turn (polykv first); writes the report after each and at the end."""
    order = sorted(cfg.systems, key=lambda s: list(SYSTEMS).index(s))
    doc: Json = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "machine": {**machine(), "threads_per_server": cfg.threads},
        "systems": {s: SYSTEMS[s] for s in order},
        "definitions": DEFINITIONS,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "notes": [],
        "runs": {},
    }
    for s in order:
        need = kv_cells_needed(s, cfg)
        if need > cfg.ctx:
            note = f"{s}: about {need:,} KV cells needed by turn 2, --ctx is {cfg.ctx:,} (requests may fail)"
            doc["notes"].append(note)
            log.warning("zeroconfig: %s", note)
    system_text: str | None = None
    history: list[list[str]] | None = None
    for s in order:
        res = run_system(s, cfg, system_text, history)
        if system_text is None and res.system_text:
            system_text = res.system_text
            doc["system_message_chars"] = len(system_text)
        if history is None and len(res.turns) == TURNS:
            history = res.answers
            doc["history_from"] = s
            doc["notes"].append(f"turn-2 histories carry {s}'s turn-1 answers, for every system")
        doc["runs"][s] = res.to_json()
        doc["comparison"] = summarize(doc["runs"])
        write(doc, cfg)
    doc["machine"]["load_avg_end"] = load_avg()
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write(doc, cfg, final=True)
    return doc


def markdown(doc: Json) -> str:
    """The report: a table per turn and system, the ratios and the answers compared, the definitions."""

    cfg, m = doc["config"], doc["machine"]
    lines = [
        "# Zero-config sharing: plain OpenAI chat requests, polykv serve against the stock server",
        "",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {cfg['threads']} threads per server, "
        f"load average at start {m['load_avg_start']}"
        + (f", at end {m['load_avg_end']}" if "load_avg_end" in m else "")
        + f". Started {doc['started']}"
        + (f", finished {doc['finished']}" if "finished" in doc else " (running)")
        + ".",
        "",
        f"N = {cfg['n']} agents at once, a system message of {cfg['prompt_tokens']:,} tokens, "
        f"{cfg['max_tokens']} greedy tokens per answer (logprobs, top {cfg['top_logprobs']}), {TURNS} turns, "
        f"{cfg['ctx']:,} KV cells per server; requests sent with the official openai package, no pool fields.",
        "",
        "Systems: " + "; ".join(f"`{k}`: {v}" for k, v in doc["systems"].items()),
        "",
        *[f"- {note}" for note in doc.get("notes", [])],
        *([""] if doc.get("notes") else []),
    ]
    rows: list[list[Any]] = []
    for name, r in doc["runs"].items():
        if "error" in r:
            rows.append([name, "error", r["error"][:60], *[None] * 9])
        for t in r["turns"]:
            statuses = ", ".join(f"{k} {v}" for k, v in t["statuses"].items())
            rows.append(
                [
                    name,
                    t["turn"],
                    t["wall_s"],
                    t["prompt_tokens_computed"],
                    t["bound_tokens"],
                    t["bound_resident_tokens"],
                    t["prompt_tokens_sent"],
                    t["common_prefix_tokens"],
                    f"{t['cached_ge_common']}/{len(t['requests'])}",
                    statuses,
                    t["waited"],
                    t["n_errors"],
                ]
            )
    headers = [
        "system",
        "turn",
        "wall s",
        "prompt tok computed",
        "bound",
        "bound (resident)",
        "prompt tok sent",
        "common prefix C",
        "cached >= C",
        "share statuses",
        "waited",
        "errors",
    ]
    lines += [table(headers, rows, markdown=True), ""]
    mismatched = [
        f"- {name} turn {t['turn']}: {t['prompt_token_mismatches']} request(s) counted other prompt tokens than "
        "the rendered prompt has (the bounds may be off)"
        for name, r in doc["runs"].items()
        for t in r["turns"]
        if t["prompt_token_mismatches"]
    ]
    lines += [*mismatched, ""] if mismatched else []
    for stock_name, pair in (doc.get("comparison") or {}).items():
        lines += comparison_lines(stock_name, pair.get("per_turn") or [])
    lines += ["## Definitions", "", *[f"- `{k}`: {v}" for k, v in doc["definitions"].items()], ""]
    return "\n".join(lines)


def comparison_lines(stock_name: str, comp: list[Json]) -> list[str]:
    """The ratio table of one stock system over polykv, and the answers that differ."""
    lines: list[str] = []
    if comp:
        crow: list[list[Any]] = []
        for c in comp:
            v = (c.get("answers") or {}).get("verdicts")
            verdicts = f"{v['identical']} / {v['near_tie']} / {v['different']}" if v else None
            crow.append([str(c["turn"]), c["wall_stock_over_polykv"], c["prompt_tokens_stock_over_polykv"], verdicts])
        lines += [
            f"## {stock_name} / polykv",
            "",
            table(
                ["turn", "wall", "prompt tokens computed", "answers identical / near tie / different"],
                crow,
                markdown=True,
            ),
            "",
        ]
        diffs = [
            (c["turn"], a)
            for c in comp
            for a in (c.get("answers") or {}).get("agents", [])
            if a["verdict"] not in ("identical",)
        ]
        lines += [f"- turn {t}, agent {a['agent']}: {a['verdict']}: {a.get('detail', '')}" for t, a in diffs]
        lines += [""] if diffs else []
    return lines


def plot(doc: Json, path: Path) -> Path | None:
    """Two panels: the stock/polykv wall ratio per turn, and prompt tokens computed per system and turn (log
    scale when they span more than 20x). None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    comparison = doc.get("comparison") or {}
    runs = {k: r for k, r in doc["runs"].items() if r.get("turns")}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ratio_width = 0.8 / max(1, len(comparison))
    for k, (stock_name, pair) in enumerate(comparison.items()):
        comp = pair.get("per_turn") or []
        xs = [i + (k - (len(comparison) - 1) / 2) * ratio_width for i in range(len(comp))]
        axes[0].bar(xs, [c["wall_stock_over_polykv"] or 0 for c in comp], ratio_width, label=stock_name,
                    color=f"C{list(runs).index(stock_name) if stock_name in runs else k + 1}")  # fmt: skip
        axes[0].set_xticks(range(len(comp)), [str(c["turn"]) for c in comp])
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_title("wall time, stock system / polykv (higher: polykv faster)")
    axes[0].set_xlabel("turn")
    axes[0].legend(fontsize=8)
    width = 0.8 / max(1, len(runs))
    values: list[float] = []
    for k, (name, r) in enumerate(runs.items()):
        ys = [max(1, t["prompt_tokens_computed"]) for t in r["turns"]]
        xs = [t["turn"] + (k - (len(runs) - 1) / 2) * width for t in r["turns"]]
        axes[1].bar(xs, ys, width, label=name, color=f"C{k}")
        values += ys
    if values and max(values) > 20 * min(values):
        axes[1].set_yscale("log")
    axes[1].set_xticks(range(1, TURNS + 1))
    axes[1].set_xlabel("turn")
    axes[1].set_title("prompt tokens computed")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    cfg = doc["config"]
    fig.suptitle(
        f"zero-config sharing, N = {cfg['n']}, P = {cfg['prompt_tokens']:,}, G = {cfg['max_tokens']}, "
        f"{doc['machine']['cpu']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(doc: Json, cfg: ZeroConfig, *, final: bool = False) -> list[Path]:
    """``<tag>.json`` and ``<tag>.md`` in the output folder, and at the end ``<tag>.png`` (with matplotlib)."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    stem = cfg.out_dir / cfg.name
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    paths[0].write_text(json.dumps(doc, indent=2))
    paths[1].write_text(markdown(doc))
    if final and doc.get("comparison"):
        png = plot(doc, stem.with_suffix(".png"))
        if png is None:
            log.info("zeroconfig: no PNG: matplotlib is not installed (pip install '.[bench]')")
        else:
            paths.append(png)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.zeroconfig``: the systems, both turns, the report."""
    ap = argparse.ArgumentParser(
        prog="python -m bench.zeroconfig", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=8, help="agents, all at once (default 8)")
    ap.add_argument("--prompt-tokens", type=int, default=2000, help="tokens of the system message (default 2000)")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per answer (default 16)")
    ap.add_argument("--ctx", type=int, default=32768, help="KV cells per server (default 32768)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per server (default 2)")
    ap.add_argument("--tag", default="", help="report name under --out (default n{N}-p{P}-g{G})")
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    ap.add_argument("--model", "-m", help="GGUF path (default: the default model)")
    ap.add_argument("--out", type=Path, default=RESULTS / "zeroconfig", help="output folder")
    args = ap.parse_args(argv)
    if args.n < 1 or args.prompt_tokens < 1 or args.max_tokens < 1:
        ap.error("--n, --prompt-tokens and --max-tokens must be positive")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in ("httpx", "httpx2"):  # polykv's client and openai's transport: a line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    cfg = ZeroConfig(
        n=args.n,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        ctx=args.ctx,
        threads=args.threads,
        systems=tuple(dict.fromkeys(args.systems)),
        tag=args.tag,
        model=args.model,
        out_dir=args.out,
    )
    run(cfg)
    log.info("zeroconfig: wrote %s.{json,md}", cfg.out_dir / cfg.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

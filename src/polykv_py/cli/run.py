"""``polykv run``: N agents over one base context.

Wire into the main parser with ``register(subparsers)``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ..errors import PolykvError
from ..fanout import Agent, BasePrompt, Fanout, FanoutError
from ..pools import PoolCache
from ..results import AgentResult, FanoutResult, PrimeResult

log = logging.getLogger("polykv.run")

#: Agent-slot defaults of a server `polykv run` starts (plus one pool slot).
DEFAULT_PARALLEL = 8
DEFAULT_CTX = 16384
DEFAULT_TEMPLATE = "\n\nQuestion: {prompt}\nAnswer:"
DEFAULT_SYSTEM = "You are a careful assistant. Answer questions about the document below, briefly and precisely."


# --------------------------------------------------------------------------- inputs
def read_text(source: str, stdin: TextIO | None = None) -> str:
    """The text of a file, or of stdin for ``-``."""
    if source == "-":
        return (stdin or sys.stdin).read()
    path = Path(source)
    if not path.is_file():
        raise FanoutError(f"no such file: {source}")
    return path.read_text(encoding="utf-8")


def _agent_from_obj(obj: Any, where: str) -> Agent:
    if isinstance(obj, str):
        return Agent(obj)
    if not isinstance(obj, dict):
        raise FanoutError(f"{where}: an agent is a string or an object, not {type(obj).__name__}")
    data = dict(obj)
    text = data.pop("prompt", None) or data.pop("instructions", None)
    if not isinstance(text, str) or not text.strip():
        raise FanoutError(f"{where}: an agent object needs a non-empty 'prompt'")
    params = dict(data.pop("params", {}) or {})
    name = str(data.pop("name", ""))
    mode = data.pop("mode", None)
    params.update(data)  # any other key is a request parameter (temperature, seed, n_predict ...)
    return Agent(text, name=name, mode=mode, params=params)


def parse_agents(text: str, fmt: str = "text") -> list[Agent]:
    """Agents from a file's text.

    ``fmt``: ``"json"`` (a list of strings or objects), ``"jsonl"`` (one per line), or
    ``"text"``: one prompt per line, blank lines and lines starting with ``#`` skipped.
    Objects hold ``prompt`` and optionally ``name``, ``mode``, ``params`` and any request
    parameter (``temperature``, ``seed``, ``n_predict`` / ``max_tokens`` ...).
    """
    if fmt == "json":
        doc = json.loads(text)
        if not isinstance(doc, list):
            raise FanoutError("a JSON agents file holds a list")
        return [_agent_from_obj(o, f"agent {i + 1}") for i, o in enumerate(doc)]
    if fmt == "jsonl":
        return [
            _agent_from_obj(json.loads(line), f"line {n}")
            for n, line in enumerate(text.splitlines(), 1)
            if line.strip()
        ]
    return [Agent(line.strip()) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def load_agents(path: str) -> list[Agent]:
    """Agents from a file (format from the extension: .json, .jsonl, else one prompt per line)."""
    text = read_text(path)
    suffix = Path(path).suffix.lower()
    fmt = "json" if suffix == ".json" else "jsonl" if suffix == ".jsonl" else "text"
    try:
        return parse_agents(text, fmt)
    except json.JSONDecodeError as exc:
        raise FanoutError(f"{path}: not valid {fmt}: {exc}") from exc


def finalize_agents(agents: list[Agent], base: BasePrompt, *, max_tokens: int, sampling: dict[str, Any]) -> list[Agent]:
    """Give every agent a name, a length limit and the command line's sampling, under its own params."""
    out = []
    for i, a in enumerate(agents):
        mode = a.resolved_mode(base)
        defaults: dict[str, Any] = dict(sampling)
        defaults["max_tokens" if mode == "chat" else "n_predict"] = max_tokens
        out.append(Agent(a.instructions, name=a.name or f"agent-{i + 1}", mode=mode, params={**defaults, **a.params}))
    return out


# --------------------------------------------------------------------------- progress
def prime_line(p: PrimeResult) -> str:
    """How a priming is reported: restored from the pool cache, or computed (and saved)."""
    if p.restored_from:
        ms = f"{p.restore_ms:.0f} ms" if p.restore_ms is not None else f"{p.wall_s * 1000:.0f} ms"
        return (
            f"pool restored from the pool cache: {p.n_tokens} tokens, no base token computed ({ms}, {p.restored_from})"
        )
    saved = f", saved to the pool cache as {p.saved_to}" if p.saved_to else ""
    return f"pool primed: {p.n_tokens} tokens in {p.wall_s:.1f}s ({p.reason}){saved}"


class Progress:
    """A one-line progress display on a terminal (log lines otherwise)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, enabled: bool = True) -> None:
        self.total = total
        self.stream = stream
        self.enabled = enabled
        self.tty = enabled and stream.isatty()
        self.t0 = time.perf_counter()
        self.running = 0
        self.done = 0
        self.hits = 0
        self.primes = 0

    def __call__(self, event: str, payload: Any) -> None:
        if not self.enabled:
            return
        if event == "prime" and isinstance(payload, PrimeResult):
            self.primes += 1
            self._say(prime_line(payload), keep=True)
        elif event == "start":
            self.running += 1
        elif event == "done" and isinstance(payload, AgentResult):
            self.running -= 1
            self.done += 1
            self.hits += payload.prefix_reused
            if payload.error:
                self._say(f"{payload.name} failed: {payload.error}", keep=True)
            elif not self.tty:
                self._say(
                    f"{payload.name} done: {payload.status}, {payload.processed} prompt tokens computed, "
                    f"{payload.latency_s:.1f}s",
                    keep=True,
                )
        self._bar()

    def _bar(self) -> None:
        if self.tty:
            width = 24
            filled = int(width * self.done / max(self.total, 1))
            line = (
                f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} agents, "
                f"{self.running} running, {self.hits} prefix reused, {time.perf_counter() - self.t0:.1f}s"
            )
            self.stream.write(line)
            self.stream.flush()

    def _say(self, msg: str, keep: bool = False) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + msg + "\n")
        else:
            self.stream.write(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


# --------------------------------------------------------------------------- run
def _build_base(args: argparse.Namespace) -> BasePrompt:
    if args.base is None and sys.stdin.isatty():
        raise FanoutError("no base context: pass --base FILE (or - for stdin), or pipe it in")
    text = read_text(args.base or "-")
    if not text.strip():
        raise FanoutError("the base context is empty")
    if args.mode == "completion":
        return BasePrompt.from_text(text)
    return BasePrompt.chat(system=args.system, document=text)


def _collect_agents(args: argparse.Namespace) -> list[Agent]:
    agents = [Agent(p) for p in args.prompts]
    if args.agents:
        agents += load_agents(args.agents)
    if not agents:
        raise FanoutError("no agents: give prompts as arguments or --agents FILE")
    if args.mode == "completion":  # the text that follows the base: the template around each prompt
        agents = [dataclasses.replace(a, instructions=args.template.format(prompt=a.instructions)) for a in agents]
    return agents


async def _fanout(
    url: str,
    base: BasePrompt,
    agents: list[Agent],
    args: argparse.Namespace,
    progress: Progress,
    kv: Any,
    server: Any = None,
    pool_cache: PoolCache | None = None,
) -> tuple[FanoutResult, FanoutResult | None]:
    if args.gateway:
        if args.compare:
            raise FanoutError("--compare runs the agents again without sharing on one server: not with --gateway")
        return await _fanout_routed(args.gateway, base, agents, args, progress, pool_cache), None
    async with Fanout.connect(
        url,
        base,
        api_key=args.api_key,
        server=server,
        pool_slot=args.pool_slot,
        concurrency=args.concurrency,
        timeout=args.timeout,
        max_connections=max(64, (args.concurrency or 0) + 8),
        pool_cache=pool_cache,
    ) as ctx:
        if kv is not None:
            kv.mark()
        result = await ctx.run(agents, progress=progress)
        if kv is not None:
            await asyncio.sleep(0.3)  # let the server's log thread write its last lines
            result.kv_cells_peak, result.kv_cells_method = kv.read().peak, _kv_method()
        baseline = None
        if args.compare:
            concurrency = args.concurrency
            if not args.url:  # without sharing every agent in flight holds its whole prompt: only so many fit
                per_agent = max([len(await ctx.agent_tokens(a)) for a in agents]) + args.max_tokens
                fit = max(1, (args.ctx - 64) // per_agent)
                concurrency = min(concurrency or len(agents), fit)
                progress._say(
                    f"without sharing: {concurrency} agents at once fit in -c {args.ctx} ({per_agent} cells each)",
                    keep=True,
                )
            ctx_plain = Fanout(ctx.client, base, share=False, concurrency=concurrency)
            plain_agents = [Agent(a.instructions, a.name, a.mode, {**a.params, "cache_prompt": False}) for a in agents]
            if kv is not None:
                await _erase_slots(ctx)
                kv.mark()
            progress.total, progress.done, progress.hits = len(agents), 0, 0
            baseline = await ctx_plain.run(plain_agents, progress=progress)
            if kv is not None:
                await asyncio.sleep(0.3)
                baseline.kv_cells_peak, baseline.kv_cells_method = kv.read().peak, _kv_method()
        return result, baseline


async def _fanout_routed(
    gateway: str,
    base: BasePrompt,
    agents: list[Agent],
    args: argparse.Namespace,
    progress: Progress,
    pool_cache: PoolCache | None,
) -> FanoutResult:
    """The fan-out through a gateway: the pool's routing key pins it and its agents to one replica."""
    from ..routing import Router

    async with Router(gateway, model=args.served_model, api_key=args.api_key, timeout=args.timeout) as router:
        ctx = router.context(base, concurrency=args.concurrency, pool_cache=pool_cache)
        try:
            result = await ctx.run(agents, progress=progress)
        finally:
            await ctx.aclose()
        progress._say(f"pool {ctx.key} on {ctx.home} (slot {ctx.pool_slot})", keep=True)
        return result


def pool_cache_of(args: argparse.Namespace) -> PoolCache | None:
    """The pool cache ``--pool-cache`` / ``--no-pool-cache`` ask for (see the option's help)."""
    if args.no_pool_cache:
        return None
    if args.pool_cache == "server" or (args.gateway and not args.pool_cache):
        return PoolCache(None)  # the files live where the server (each replica) saves them
    if args.pool_cache:
        return PoolCache(args.pool_cache)
    return None if args.url else PoolCache.default()


async def _erase_slots(ctx: Fanout) -> None:
    """Empty every slot (pool included) so a baseline run starts from an empty KV cache."""
    for slot in range(await ctx.slot_count()):
        try:
            await ctx.client.erase_slot(slot)
        except PolykvError as exc:
            log.debug("could not erase slot %d: %s", slot, exc)


def _kv_method() -> str:
    from ..harness.kvcells import KV_METHOD

    return KV_METHOD


def print_answers(result: FanoutResult, out: TextIO) -> None:
    for a in result.agents:
        out.write(f"### {a.name} [{a.status}, P={a.requested}, {a.processed} prompt tokens computed]\n")
        out.write(a.text.strip() + "\n\n")


def _quiet_http_log() -> None:
    """httpx logs every request at INFO: keep that for -v only."""
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        logging.getLogger("httpx").setLevel(logging.WARNING)


def _cmd_run(args: argparse.Namespace) -> int:
    from ..harness import report

    _quiet_http_log()
    base = _build_base(args)
    agents = finalize_agents(
        _collect_agents(args),
        base,
        max_tokens=args.max_tokens,
        sampling={k: v for k, v in (("temperature", args.temperature), ("seed", args.seed)) if v is not None},
    )
    progress = Progress(len(agents), enabled=not args.no_progress)
    pool_cache = pool_cache_of(args)
    server = None
    info: dict[str, Any] = {}
    t_start = time.perf_counter()
    try:
        if args.url or args.gateway:
            url, kv = args.url or args.gateway, None
        else:
            from ..harness.kvcells import KVCellsLog
            from ..presets import pool_server

            parallel = args.parallel or min(len(agents), DEFAULT_PARALLEL)
            server = pool_server(
                model=args.model,
                n_agents_parallel=parallel,
                ctx=args.ctx,
                threads=args.threads,
                extra_args=args.server_arg or (),
                track_kv=not args.no_kv,
                slot_save_path=pool_cache.save_path if pool_cache else None,
                shared_decode=not args.no_shared_decode,
                share_any=not args.no_share_any,
            )
            progress._say(
                f"starting the patched llama-server ({parallel} agent slots + 1 pool slot, -c {args.ctx}) ...",
                keep=True,
            )
            server.start()
            url = server.url
            kv = None if args.no_kv else KVCellsLog(server.log_path)
            info = {
                "server": str(server.binary),
                "model": str(server.model),
                "log": str(server.log_path),
                "args": server.args,
            }
        result, baseline = asyncio.run(_fanout(url, base, agents, args, progress, kv, server, pool_cache))
        if server is not None:
            info["rss_mib"] = round(server.usage().rss_bytes / 2**20, 1)
    finally:
        progress.close()
        if server is not None:
            server.stop()
    if args.json:
        doc = {"url": url, **info, "total_s": round(time.perf_counter() - t_start, 3), "result": result.to_json()}
        if baseline is not None:
            doc["baseline"] = baseline.to_json()
        print(report.dumps(doc))
        return 0
    out = sys.stdout
    print_answers(result, out)
    out.write(report.agents_table(result) + "\n\n")
    out.write(report.summary_table(result, baseline) + "\n")
    out.write(report.statuses_line(result) + "\n")
    if result.kv_cells_method:
        out.write(f"KV cells measured from the {result.kv_cells_method}\n")
    if info.get("rss_mib"):
        out.write(f"server RSS after the run: {info['rss_mib']} MiB; model {Path(info['model']).name}\n")
    return 0


# --------------------------------------------------------------------------- parser
HELP = "run N agents over one shared base context (prefix computed and stored once)"
DESCRIPTION = (
    "Prime a pool slot with the base context and fan the agents out over it. Starts the patched llama-server "
    "on the default model unless --url names a running one."
)


def register(subparsers: Any) -> None:
    """Add ``run`` to the ``polykv`` command's subparsers."""
    add_arguments(subparsers.add_parser("run", help=HELP, description=DESCRIPTION))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``polykv run``'s options; runs :func:`_cmd_run`."""
    p.add_argument("prompts", nargs="*", help="agent prompts (one agent each)")
    p.add_argument("--base", "-b", help="base context file (- for stdin; default: stdin when piped)")
    p.add_argument("--agents", "-a", help="agents file: one prompt per line, or .json / .jsonl objects")
    p.add_argument(
        "--mode",
        choices=["chat", "completion"],
        default="chat",
        help="chat: the base is a system message, each agent a user message (default); "
        "completion: each prompt is base text + agent text",
    )
    p.add_argument("--system", default=DEFAULT_SYSTEM, help="system prompt placed before the document (chat mode)")
    p.add_argument(
        "--template",
        default=DEFAULT_TEMPLATE,
        help="completion mode: text appended to the base for each agent ({prompt} is the agent's "
        "prompt; default %(default)r)",
    )
    p.add_argument("--max-tokens", "-n", type=int, default=128, help="tokens to generate per agent (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: agent slots)")
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds a request may wait for the server's next bytes (default 1800)",
    )
    p.add_argument("--url", help="use a running patched llama-server (-kvu --no-clear-idle) instead of starting one")
    p.add_argument(
        "--gateway",
        metavar="URL",
        help="send the agents through a gateway in front of patched replicas (polykv cluster; smg): the pool's "
        "routing key keeps the pool and its agents on one replica (pool files: the replicas' --slot-save-path)",
    )
    p.add_argument("--served-model", default="polykv", help="with --gateway: the replicas' model id (default polykv)")
    p.add_argument("--api-key", default=os.environ.get("POLYKV_API_KEY"), help="API key for --url / --gateway")
    p.add_argument("--pool-slot", type=int, default=0, help="slot that holds the base (default 0)")
    p.add_argument(
        "--pool-cache",
        metavar="DIR",
        help="pool files: restore the base from here instead of computing it, save it after computing it "
        "(default for a started server: $POLYKV_CACHE_DIR/pools; with --url: off, or 'server' for the "
        "server's own --slot-save-path)",
    )
    p.add_argument("--no-pool-cache", action="store_true", help="always compute the base; save nothing")
    p.add_argument("--model", "-m", help="GGUF path (default: $POLYKV_MODEL or the default model)")
    p.add_argument(
        "--parallel",
        type=int,
        default=None,
        help=f"agent slots of a started server (default: agents, at most {DEFAULT_PARALLEL})",
    )
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help=f"KV cells of a started server (default {DEFAULT_CTX})")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads of a started server")
    p.add_argument("--server-arg", action="append", help="extra llama-server flag (repeatable)")
    p.add_argument("--no-kv", action="store_true", help="don't measure KV cells (no server debug log)")
    p.add_argument(
        "--no-shared-decode",
        action="store_true",
        help="a started server decodes with upstream's attention kernel (default: --shared-decode)",
    )
    p.add_argument(
        "--no-share-any",
        action="store_true",
        help="a started server shares only the declared pool, not prefixes other slots computed (default: --share-any)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run the agents without sharing or prompt cache, for a measured comparison",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.set_defaults(func=_cmd_run)

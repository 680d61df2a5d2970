"""The agent framework examples against ``polykv serve`` and the stock server with the same slots.

Runs ``examples/agents/langgraph_agents.py`` and ``examples/agents/openai_agents_sdk.py`` (N agents over the
~2,000-token design document as their system prompt, two turns each) against two servers, each as
``polykv serve`` starts it (:func:`polykv_py.serve.build_server`): polykv (zero-config sharing, shared decode)
and ``polykv serve --upstream`` (the pristine server with its own defaults, the same 10 slots over the same
32,768 unified KV cells, the same threads and chat template). Each run gets a fresh server and no pool cache,
so no run starts from an earlier one's promoted prefixes. Writes ``agents.json`` and ``agents.md``::

    python -m bench.agents                 # 8 agents, 2 turns
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from polykv_py.harness.report import table
from polykv_py.llama_server import free_port
from polykv_py.serve import ServeOptions, build_server

from . import RESULTS
from .machine import load_avg, machine

log = logging.getLogger("bench.agents")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"
FRAMEWORKS = {"langgraph": "langgraph_agents.py", "openai-agents": "openai_agents_sdk.py"}
SYSTEMS = ("polykv", "stock")


def run_once(framework: str, system: str, agents: int, turns: int, logs: Path) -> dict[str, Any]:
    """One example against one fresh server: the framework's reported usage, the server's computed tokens."""
    opts = ServeOptions(port=free_port(), upstream=system == "stock", no_pool_cache=True, log_dir=str(logs))
    server, _, _ = build_server(opts)
    server.start()
    try:
        before = server.client.metrics()["llamacpp:prompt_tokens_total"]
        argv = [sys.executable, str(EXAMPLES / FRAMEWORKS[framework]), "--base-url", f"{server.url}/v1",
                "--agents", str(agents), "--turns", str(turns), "--json"]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=3600)
        wall = time.perf_counter() - t0
        computed = server.client.metrics()["llamacpp:prompt_tokens_total"] - before
    finally:
        server.stop()
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    calls = summary["calls"]
    return {
        "framework": framework,
        "system": system,
        "calls": len(calls),
        "prompt_tokens": sum(c["prompt_tokens"] for c in calls),
        "cached_tokens": sum(c["cached_tokens"] for c in calls),
        "computed_tokens": int(computed),
        "wall_s": round(summary["wall_s"], 2),  # the agents' run, as the example timed it
        "process_s": round(wall, 2),  # the example's process: imports and start-up included
        "first_call_cached": [next(c["cached_tokens"] for c in calls if c["agent"] == a) for a in range(1, agents + 1)],
        "tool_calls_by_model": sum(c["tool_calls"] for c in calls),
        "calls_detail": calls,  # every model call: agent, turn, prompt and cached tokens as the framework saw them
    }


def markdown(doc: dict[str, Any]) -> str:
    rows = []
    for framework in doc["frameworks"]:
        runs = {r["system"]: r for r in doc["runs"] if r["framework"] == framework}
        for system in SYSTEMS:
            r = runs[system]
            speedup = runs["stock"]["wall_s"] / r["wall_s"]
            rows.append([framework, system, r["calls"], r["prompt_tokens"], r["cached_tokens"], r["computed_tokens"],
                         r["wall_s"], round(speedup, 2)])  # fmt: skip
    headers = ["framework", "server", "calls", "prompt tokens", "cached", "computed", "wall s", "x stock"]
    m = doc["machine"]
    return (
        f"# Agent frameworks: {doc['agents']} agents x {doc['turns']} turns, polykv serve vs the stock server\n\n"
        f"{m['cpu']}, {m['logical_cpus']} logical CPUs; load average {m['load_avg_start']} at start, "
        f"{m['load_avg_end']} at end. Each run on a fresh server, no pool cache; the stock server is "
        "`polykv serve --upstream` (its own defaults, the same slots, KV cells, threads and template).\n\n"
        + table(headers, rows, markdown=True)
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--frameworks", nargs="+", choices=sorted(FRAMEWORKS), default=list(FRAMEWORKS))
    parser.add_argument("--out", type=Path, default=RESULTS / "agents")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="polykv-bench-agents-"))  # the servers' logs: not part of the report
    doc: dict[str, Any] = {"agents": args.agents, "turns": args.turns, "frameworks": args.frameworks,
                           "machine": machine(), "runs": []}  # fmt: skip
    for framework in args.frameworks:
        for system in SYSTEMS:
            run = run_once(framework, system, args.agents, args.turns, logs)
            log.info("%s on %s: %s", framework, system, {k: v for k, v in run.items() if k != "calls_detail"})
            doc["runs"].append(run)
    doc["machine"]["load_avg_end"] = load_avg()
    (args.out / "agents.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = markdown(doc)
    (args.out / "agents.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What both framework examples share: the document, the questions, the stub tool's text, the command line
and the summary. Run an example as a script (``python examples/agents/langgraph_agents.py``): its folder is then
on the import path, so ``import common`` finds this file."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: The system prompt every agent shares: the ~2,000-token design document.
DOC = (HERE.parent / "design-doc.md").read_text(encoding="utf-8")
#: One question per agent (cycled when there are more agents than questions).
QUESTIONS = [q for q in (HERE.parent / "agents.txt").read_text().splitlines() if q and not q.startswith("#")]
#: Every agent's later turns.
FOLLOW_UP = "Now say it again in one short sentence."


def section_text(number: int) -> str:
    """Section ``number`` of the document (the stub tool's answer)."""
    parts = re.split(r"^## ", DOC, flags=re.M)
    return next((p for p in parts if p.startswith(f"{number}.")), f"there is no section {number}")


def parse_args(description: str) -> argparse.Namespace:
    """The examples' common command line."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream", action="store_true", help="stream every call (usage in the last chunk)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary line at the end")
    return parser.parse_args()


def questions(n_agents: int) -> list[str]:
    """Agent i's first question."""
    return [QUESTIONS[i % len(QUESTIONS)] for i in range(n_agents)]


def print_call(agent: int, turn: int, name: str, row: dict[str, Any]) -> None:
    """One line per model call: its prompt tokens and how many the server reused."""
    print(
        f"agent {agent} turn {turn} {name:10s} prompt {row['prompt_tokens']:5d}  cached {row['cached_tokens']:5d}"
        f"  tool calls {row['tool_calls']}",
        flush=True,
    )


def summarize(framework: str, rows: list[dict[str, Any]], wall: float, *, as_json: bool, **extra: Any) -> None:
    """The totals line, and with ``as_json`` one JSON line with every call (what the tests and bench.agents read)."""
    prompt, cached = sum(r["prompt_tokens"] for r in rows), sum(r["cached_tokens"] for r in rows)
    print(f"{len(rows)} calls, {prompt} prompt tokens, {cached} cached, {prompt - cached} computed, {wall:.1f} s")
    if as_json:
        print(json.dumps({"framework": framework, "wall_s": wall, "calls": rows, **extra}))

"""The agent framework examples (examples/agents/) run as they are against ``polykv serve`` and share.

Each example runs in a process of its own, as a user runs it, against the launcher started with its
defaults (zero-config sharing, the default model's tools template). Checked from what the frameworks
themselves report (``cached_tokens`` in each call's usage) and from the server's own counter:

- every agent but the first has at least the document's system turn cached on its first call;
- every agent's second turn reuses its whole first turn (the framework resends it: tool call and result
  included in the LangGraph example);
- the tokens the server computed (``/metrics``) are the frameworks' prompt tokens minus their cached
  tokens: the reported numbers are the work done;
- streamed runs report usage (the last chunk's ``cached_tokens``) when they ask for it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_process import polykv_serve

from polykv_py.client import Client

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "agents"
DOC = ROOT / "examples" / "design-doc.md"
AGENTS = 4


@pytest.fixture(scope="module")
def server(logs: Path) -> Iterator[str]:
    """``polykv serve`` with its defaults (no pool cache, so a run starts cold), on a free port."""
    with polykv_serve("--no-pool-cache", "--agent-slots", str(AGENTS), "--auto-pools", "1", "--log-dir", str(logs),
                      "--", "-c", "24576", "-t", "2") as (url, _):  # fmt: skip
        yield url


def run_example(script: str, url: str, *args: str) -> dict[str, Any]:
    """Run one example against ``url``; its JSON summary."""
    argv = [sys.executable, str(EXAMPLES / script), "--base-url", f"{url}/v1", "--json", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def document_turn(client: Client) -> int:
    """Tokens of the system turn up to the document's end (the part every agent's system turn starts with)."""
    rendered = client.apply_template([{"role": "system", "content": DOC.read_text()}], add_generation_prompt=False)
    return len(client.prompt_tokens(rendered.removesuffix("<|im_end|>\n"))) - 1


def computed_tokens(client: Client) -> float:
    return client.metrics()["llamacpp:prompt_tokens_total"]


@pytest.mark.parametrize("script", ["langgraph_agents.py", "openai_agents_sdk.py"])
def test_example_shares_the_system_turn_and_histories(server: str, script: str) -> None:
    client = Client(server)
    before = computed_tokens(client)
    summary = run_example(script, server, "--agents", str(AGENTS), "--turns", "2")
    computed = computed_tokens(client) - before
    calls = summary["calls"]
    doc = document_turn(client)
    firsts = [min((c for c in calls if c["agent"] == a), key=lambda c: c["turn"]) for a in range(1, AGENTS + 1)]
    assert all(c["turn"] == 1 and c["prompt_tokens"] > doc for c in firsts)
    assert sum(c["cached_tokens"] >= doc for c in firsts) >= AGENTS - 1, firsts
    for agent in range(1, AGENTS + 1):
        mine = [c for c in calls if c["agent"] == agent]
        last_of_turn1 = [c for c in mine if c["turn"] == 1][-1]
        first_of_turn2 = next(c for c in mine if c["turn"] == 2)
        assert first_of_turn2["cached_tokens"] >= last_of_turn1["prompt_tokens"] - 1, mine
    assert computed == sum(c["prompt_tokens"] - c["cached_tokens"] for c in calls)
    assert computed < 0.25 * sum(c["prompt_tokens"] for c in calls)
    assert len(summary["answers"]) == AGENTS and all(summary["answers"])


@pytest.mark.parametrize("script", ["langgraph_agents.py", "openai_agents_sdk.py"])
def test_streamed_runs_report_cached_tokens(server: str, script: str) -> None:
    summary = run_example(script, server, "--agents", "2", "--turns", "1", "--stream")
    doc = document_turn(Client(server))
    assert all(c["prompt_tokens"] > doc for c in summary["calls"]), summary["calls"]
    assert all(c["cached_tokens"] >= doc for c in summary["calls"]), summary["calls"]  # the document is warm by now

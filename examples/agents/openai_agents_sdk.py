"""N agents built with the OpenAI Agents SDK over one shared system prompt, against `polykv serve`.

Each agent is a researcher (instructions: the ~2,000-token design document; a tool that reads one of its
sections) that may hand off to a reviewer (the SDK's handoff: a `transfer_to_reviewer` tool). Every agent's
second turn resends its first turn's items (`result.to_input_list()`), as a chat application does.

    polykv serve &                       # zero-config: nothing declared
    python examples/agents/openai_agents_sdk.py --agents 8 --turns 2

The SDK asks a server that is not OpenAI's for no usage in a stream: `ModelSettings(include_usage=True)` does
(--stream). Tracing is turned off: it would send every run to OpenAI. Prints one line per model call
(prompt tokens, cached_tokens as the server reports them) and, with --json, one JSON summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    RunResult,
    RunResultStreaming,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

HERE = Path(__file__).resolve().parent
DOC = (HERE.parent / "design-doc.md").read_text(encoding="utf-8")
QUESTIONS = [q for q in (HERE.parent / "agents.txt").read_text().splitlines() if q and not q.startswith("#")]
FOLLOW_UP = "Now say it again in one short sentence."


@function_tool
def read_section(number: int) -> str:
    """Read one numbered section (1-9) of the design document."""
    parts = re.split(r"^## ", DOC, flags=re.M)
    return next((p for p in parts if p.startswith(f"{number}.")), f"there is no section {number}")


def build_agents(client: AsyncOpenAI, settings: ModelSettings) -> Agent[Any]:
    """The researcher, which can hand off to the reviewer; both see the document first."""
    model = OpenAIChatCompletionsModel(model="polykv", openai_client=client)
    reviewer: Agent[Any] = Agent(
        name="reviewer",
        instructions=DOC + "\n\nYou review answers about this document and correct them.",
        tools=[read_section],
        model=model,
        model_settings=settings,
    )
    return Agent(
        name="researcher",
        instructions=DOC + "\n\nYou answer questions about this document; hand off to the reviewer to check.",
        tools=[read_section],
        handoffs=[reviewer],
        model=model,
        model_settings=settings,
    )


def usage_rows(agent: int, turn: int, result: RunResult | RunResultStreaming) -> list[dict[str, Any]]:
    """One row per model call of a run (its usage as the server reported it)."""
    rows = []
    for response in result.raw_responses:
        usage = response.usage
        row = {
            "agent": agent,
            "turn": turn,
            "prompt_tokens": usage.input_tokens,
            "cached_tokens": usage.input_tokens_details.cached_tokens,
            "tool_calls": sum(1 for item in response.output if getattr(item, "type", "") == "function_call"),
        }
        print(
            f"agent {agent} turn {turn} {result.last_agent.name:10s} prompt {row['prompt_tokens']:5d}  "
            f"cached {row['cached_tokens']:5d}  tool calls {row['tool_calls']}",
            flush=True,
        )
        rows.append(row)
    return rows


async def run_agent(researcher: Agent[Any], agent: int, question: str, turns: int, stream: bool) -> dict[str, Any]:
    items: list[Any] = []
    current, rows, answer = researcher, [], ""
    for turn in range(1, turns + 1):
        items.append({"role": "user", "content": question if turn == 1 else FOLLOW_UP})
        if stream:
            result: RunResult | RunResultStreaming = Runner.run_streamed(current, items, max_turns=4)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(current, items, max_turns=4)
        rows += usage_rows(agent, turn, result)
        items, current, answer = result.to_input_list(), result.last_agent, str(result.final_output)
    return {"rows": rows, "answer": answer, "last_agent": current.name}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream", action="store_true", help="stream every call (usage in the last chunk)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary line at the end")
    args = parser.parse_args()

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=args.base_url, api_key="unused")
    settings = ModelSettings(temperature=0, max_tokens=args.max_tokens, include_usage=True)
    researcher = build_agents(client, settings)
    t0 = time.perf_counter()
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.agents)]
    runs = await asyncio.gather(
        *(run_agent(researcher, i + 1, q, args.turns, args.stream) for i, q in enumerate(questions))
    )
    wall = time.perf_counter() - t0
    rows = [row for run in runs for row in run["rows"]]
    prompt, cached = sum(r["prompt_tokens"] for r in rows), sum(r["cached_tokens"] for r in rows)
    print(f"{len(rows)} calls, {prompt} prompt tokens, {cached} cached, {prompt - cached} computed, {wall:.1f} s")
    if args.json:
        summary = {"framework": "openai-agents", "wall_s": wall, "calls": rows, "answers": [r["answer"] for r in runs],
                   "last_agents": [r["last_agent"] for r in runs]}  # fmt: skip
        print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())

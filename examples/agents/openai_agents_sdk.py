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

import asyncio
import time
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
from common import DOC, FOLLOW_UP, parse_args, print_call, questions, section_text, summarize
from openai import AsyncOpenAI


@function_tool
def read_section(number: int) -> str:
    """Read one numbered section (1-9) of the design document."""
    return section_text(number)


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
        print_call(agent, turn, result.last_agent.name, row)
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
    args = parse_args(__doc__.split("\n\n")[0])

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=args.base_url, api_key="unused")
    settings = ModelSettings(temperature=0, max_tokens=args.max_tokens, include_usage=True)
    researcher = build_agents(client, settings)
    t0 = time.perf_counter()
    first = questions(args.agents)
    runs = await asyncio.gather(
        *(run_agent(researcher, i + 1, q, args.turns, args.stream) for i, q in enumerate(first))
    )
    rows = [row for run in runs for row in run["rows"]]
    summarize("openai-agents", rows, time.perf_counter() - t0, as_json=args.json,
              answers=[r["answer"] for r in runs], last_agents=[r["last_agent"] for r in runs])  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())

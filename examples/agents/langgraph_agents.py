"""N LangGraph agents over one shared system prompt, against `polykv serve` (or any OpenAI-compatible server).

Each agent is a graph: a researcher that reads a section of the design document through a tool and answers,
then hands off to a reviewer that checks the answer (`Command(goto="reviewer")`, LangGraph's handoff). All
agents share one ~2,000-token system message (the document) and one tool list; each keeps its conversation in
a checkpointer thread, so its second turn resends its history (tool calls and results included).

    polykv serve &                       # zero-config: nothing declared
    python examples/agents/langgraph_agents.py --agents 8 --turns 2

Prints one line per model call (prompt tokens, cached_tokens as the server reports them) and, with --json,
one JSON summary line. --stream streams every call and asks for usage in the stream (stream_usage=True).
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, Literal

from common import DOC, FOLLOW_UP, parse_args, print_call, questions, section_text, summarize
from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
    message_chunk_to_message,
)
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.types import Command

SECTIONS = dict(re.findall(r"^## (\d+)\. (.+)$", DOC, flags=re.M))


@tool
def read_section(number: int) -> str:
    """Read one numbered section (1-9) of the design document."""
    return section_text(number)


def pick_section(question: str) -> int:
    """The section whose title shares the most words with the question (the researcher's first tool call)."""
    words = set(re.findall(r"\w+", question.lower()))
    return int(max(SECTIONS, key=lambda n: len(words & set(re.findall(r"\w+", SECTIONS[n].lower())))))


class Calls:
    """Every model call's usage, per agent: what the server computed and what it reused."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, agent: int, turn: int, node: str, message: AIMessage) -> None:
        usage = message.usage_metadata or {}
        row = {
            "agent": agent,
            "turn": turn,
            "node": node,
            "prompt_tokens": usage.get("input_tokens", 0),
            "cached_tokens": (usage.get("input_token_details") or {}).get("cache_read", 0),
            "tool_calls": len(message.tool_calls),
        }
        self.rows.append(row)
        print_call(agent, turn, node, row)


def build_graph(llm: ChatOpenAI, calls: Calls, *, stream: bool) -> Any:
    model = llm.bind_tools([read_section])
    system = SystemMessage(DOC)

    async def call(messages: list[AnyMessage], config: RunnableConfig, node: str) -> AIMessage:
        if stream:  # the usage comes in the stream's last chunk (stream_usage=True)
            chunks = [chunk async for chunk in model.astream([system, *messages])]
            message = message_chunk_to_message(sum(chunks[1:], chunks[0]))
            assert isinstance(message, AIMessage)
        else:
            message = await model.ainvoke([system, *messages])
        calls.add(config["configurable"]["agent"], config["configurable"]["turn"], node, message)
        return message

    async def lookup(state: MessagesState) -> dict[str, Any]:
        """The researcher's first step: read the section the question is about (a tool call, run by the tools node)."""
        question = next(m for m in reversed(state["messages"]) if isinstance(m, HumanMessage))
        number = pick_section(str(question.content))
        call_id = f"call_{len(state['messages'])}"
        call = {"name": "read_section", "args": {"number": number}, "id": call_id}
        return {"messages": [AIMessage("", tool_calls=[call])]}

    async def tools(state: MessagesState) -> dict[str, Any]:
        last = state["messages"][-1]
        assert isinstance(last, AIMessage)
        results = [ToolMessage(await read_section.ainvoke(c["args"]), tool_call_id=c["id"]) for c in last.tool_calls]
        return {"messages": results}

    async def researcher(state: MessagesState, config: RunnableConfig) -> Command[Literal["tools", "reviewer"]]:
        answer = await call(state["messages"], config, "researcher")
        if answer.tool_calls and len(state["messages"]) < 12:  # the model asked for another section
            return Command(goto="tools", update={"messages": [answer]})
        handoff = HumanMessage("Reviewer: check the researcher's answer against the document and correct it.")
        return Command(goto="reviewer", update={"messages": [answer.model_copy(update={"tool_calls": []}), handoff]})

    async def reviewer(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        answer = await call(state["messages"], config, "reviewer")
        return {"messages": [answer.model_copy(update={"tool_calls": []})]}

    def first_step(state: MessagesState) -> str:
        """A new conversation starts with the lookup; a later turn goes straight to the researcher."""
        return "researcher" if any(isinstance(m, ToolMessage) for m in state["messages"]) else "lookup"

    graph = StateGraph(MessagesState)
    graph.add_node("lookup", lookup)
    graph.add_node("tools", tools)
    graph.add_node("researcher", researcher)
    graph.add_node("reviewer", reviewer)
    graph.add_conditional_edges(START, first_step, ["lookup", "researcher"])
    graph.add_edge("lookup", "tools")
    graph.add_edge("tools", "researcher")
    return graph.compile(checkpointer=InMemorySaver())


async def run_agent(graph: Any, agent: int, question: str, turns: int) -> str:
    answer = ""
    for turn in range(1, turns + 1):
        config = {"configurable": {"thread_id": f"agent-{agent}", "agent": agent, "turn": turn}}
        text = question if turn == 1 else FOLLOW_UP
        state = await graph.ainvoke({"messages": [HumanMessage(text)]}, config)
        answer = str(state["messages"][-1].content)
    return answer


async def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])

    llm = ChatOpenAI(model="polykv", base_url=args.base_url, api_key="unused", temperature=0,
                     max_tokens=args.max_tokens, stream_usage=True)  # fmt: skip
    calls = Calls()
    graph = build_graph(llm, calls, stream=args.stream)
    t0 = time.perf_counter()
    first = questions(args.agents)
    answers = await asyncio.gather(*(run_agent(graph, i + 1, q, args.turns) for i, q in enumerate(first)))
    summarize("langgraph", calls.rows, time.perf_counter() - t0, as_json=args.json, answers=answers)


if __name__ == "__main__":
    asyncio.run(main())

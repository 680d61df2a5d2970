"""Tools reach the default model, and tool-call histories share exactly.

The default model's own chat template cannot render tools: the server drops a request's tool list (and
``tool_choice``) without an error, the stock server as much as ours. ``polykv serve`` gives the default model
polykv's ChatML template with tools (:func:`polykv_py.presets.tools_template`) and warns when a model's
template cannot render tools. Checked here, on the real servers:

- without tools the template renders what the model's own renders, byte for byte (so a tool-less request's
  prompt, and answer, is unchanged); with tools it lists them in the system turn and renders assistant
  ``tool_calls`` and ``role: tool`` results, which llama-server turns back into OpenAI ``tool_calls``;
- a tool-call history (the assistant's call, the tool's result, as every framework resends them) reuses the
  turn before it and shares the system turn with another agent, and its answer equals the reference
  server's, which has the same template and no sharing;
- a request with tools and one without share only their common tokens: exactly the common prefix of their
  tokenized prompts, not the system turn the tools changed;
- ``polykv serve`` warns at start when the template cannot render tools, and ``/props`` says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from serve_process import polykv_serve

from polykv_py.client import Client
from polykv_py.data import sample_document
from polykv_py.harness.compare import compare_chat
from polykv_py.harness.texts import repeat_to_tokens
from polykv_py.llama_server import LlamaServer
from polykv_py.native import ServerKind
from polykv_py.presets import custom_server, serve_server, stock_serve_args, template_args, tools_template
from polykv_py.tokens import shared_prefix_len

pytestmark = pytest.mark.integration

SYSTEM_TOKENS = 300
FLAGS = ("-c", "8192", "-b", "256", "-ub", "256")
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 5}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_section",
            "description": "Read one numbered section (1-9) of the design document.",
            "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
        },
    },
    {"type": "function", "function": {"name": "transfer_to_reviewer", "description": "Hand off to the reviewer.",
                                      "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip
#: Conversations without tools: the template must render them as the model's own does.
PLAIN: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}],
    [{"role": "user", "content": "ünïcödé ✓ {{ not jinja }}"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "<|im_start|>x"}],
    [{"role": "system", "content": "one"}, {"role": "system", "content": "two"}, {"role": "user", "content": "q"}],
]  # fmt: skip


def _start(server: LlamaServer) -> Iterator[Client]:
    server.start()
    try:
        yield server.client
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ours(model_path: Path, logs: Path) -> Iterator[Client]:
    """The patched server as ``polykv serve`` runs the default model: its tools template, sharing on."""
    server = serve_server(1, agent_slots=3, ctx=8192, threads=2, extra_args=[*template_args(True, []), *FLAGS],
                          model=model_path, log_dir=logs, name="tools-ours")  # fmt: skip
    yield from _start(server)


@pytest.fixture(scope="module")
def reference(model_path: Path, logs: Path) -> Iterator[Client]:
    """The pristine server with the same template and slots."""
    args = [*stock_serve_args(4, ctx=8192, threads=2), *template_args(True, []), *FLAGS]
    yield from _start(custom_server(ServerKind.UPSTREAM, args, model=model_path, log_dir=logs, name="tools-ref"))


@pytest.fixture(scope="module")
def own_template(model_path: Path, logs: Path) -> Iterator[Client]:
    """The pristine server with the model's own template."""
    args = [*stock_serve_args(1, ctx=2048, threads=1)]
    yield from _start(custom_server(ServerKind.UPSTREAM, args, model=model_path, log_dir=logs, name="tools-own"))


@pytest.fixture(scope="module")
def system(ours: Client) -> str:
    return repeat_to_tokens(sample_document()[:1500], SYSTEM_TOKENS, ours.tokenize, ours.detokenize)


def test_renders_as_the_model_without_tools(ours: Client, own_template: Client) -> None:
    assert template_args(True, []) == ["--chat-template-file", str(tools_template())]
    assert template_args(True, ["--chat-template", "chatml"]) == []  # the user's choice wins
    for messages in PLAIN:
        for gen in (True, False):
            mine = ours.apply_template(messages, add_generation_prompt=gen)
            assert mine == own_template.apply_template(messages, add_generation_prompt=gen), messages
    assert ours.props()["chat_template_caps"]["supports_tools"] is True
    assert own_template.props()["chat_template_caps"]["supports_tools"] is False


def test_renders_tools_and_tool_calls(ours: Client, own_template: Client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Section 3?"}]
    with_tools = ours.apply_template(messages, tools=TOOLS)
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "read_section"' in with_tools and '"name": "transfer_to_reviewer"' in with_tools
    assert own_template.apply_template(messages, tools=TOOLS) == own_template.apply_template(messages)  # dropped
    history = [*messages, call_message("call_1", 3), {"role": "tool", "tool_call_id": "call_1", "content": "Arch."}]
    rendered = ours.apply_template(history, tools=TOOLS)
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "read_section", "arguments": {"number": 3}}\n</tool_call>' \
        '<|im_end|>\n<|im_start|>user\n<tool_response>\nArch.\n</tool_response><|im_end|>\n' in rendered  # fmt: skip


def call_message(call_id: str, number: int) -> dict[str, Any]:
    """An assistant message that calls ``read_section(number)``, as the OpenAI API returns and frameworks resend it."""
    arguments = json.dumps({"number": number})
    call = {"id": call_id, "type": "function", "function": {"name": "read_section", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def test_tool_call_history_shares_exactly(ours: Client, reference: Client, system: str) -> None:
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "What does section 3 say?"}]
    first = ours.chat(turn1, tools=TOOLS, **GREEDY)
    assert first["usage"]["prompt_tokens"] > len(ours.tokenize(system)) + 100  # the tools are in the prompt
    history = [*turn1, call_message("call_1", 3),
               {"role": "tool", "tool_call_id": "call_1", "content": sample_document()[2000:2600]}]  # fmt: skip
    second = ours.chat(history, tools=TOOLS, **GREEDY)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
    other = [{"role": "system", "content": system}, {"role": "user", "content": "And section 5?"},
             call_message("call_2", 5), {"role": "tool", "tool_call_id": "call_2", "content": "Capacity."}]  # fmt: skip
    third = ours.chat(other, tools=TOOLS, **GREEDY)
    system_turn = len(ours.prompt_tokens(ours.apply_template(other[:1], tools=TOOLS, add_generation_prompt=False)))
    assert third["shared_prefix"]["status"] == "hit", third["shared_prefix"]
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] >= system_turn
    for messages, mine in ((history, second), (other, third)):
        theirs = reference.chat(messages, tools=TOOLS, **GREEDY)
        assert theirs["usage"]["prompt_tokens"] == mine["usage"]["prompt_tokens"]
        cmp = compare_chat(mine["choices"][0], theirs["choices"][0])
        assert cmp.ok, cmp.detail


def test_tools_and_no_tools_share_only_the_common_tokens(ours: Client, system: str) -> None:
    messages = [{"role": "system", "content": system + "\n\nA new tenant."}, {"role": "user", "content": "Hello"}]
    with_tools = ours.chat(messages, tools=TOOLS, **GREEDY)
    without = ours.chat(messages, **GREEDY)
    a = ours.prompt_tokens(ours.apply_template(messages, tools=TOOLS, add_generation_prompt=True))
    b = ours.prompt_tokens(ours.apply_template(messages, add_generation_prompt=True))
    common = shared_prefix_len(a, b)
    assert with_tools["usage"]["prompt_tokens"] == len(a) and without["usage"]["prompt_tokens"] == len(b)
    assert SYSTEM_TOKENS < common < len(b) - 3  # the system turn's end differs: "<|im_end|>" vs the tools
    assert without["usage"]["prompt_tokens_details"]["cached_tokens"] == common


def test_serve_warns_when_the_template_cannot_render_tools(logs: Path) -> None:
    with polykv_serve("--no-pool-cache", "--agent-slots", "1", "--auto-pools", "1", "--log-dir", str(logs),
                      "--", "--chat-template", "chatml", "-c", "2048", "-t", "1") as (url, lines):  # fmt: skip
        assert Client(url).props()["chat_template_caps"]["supports_tools"] is False
        assert any("WARNING polykv.serve: the model's chat template cannot render tools" in line for line in lines)
    with polykv_serve("--no-pool-cache", "--agent-slots", "1", "--auto-pools", "1", "--log-dir", str(logs),
                      "--", "-c", "2048", "-t", "1") as (url, lines):  # fmt: skip
        props = Client(url).props()
        assert props["chat_template_caps"]["supports_tools"] is True
        assert not any("cannot render tools" in line for line in lines)


def test_a_stream_reports_cached_tokens_and_the_share_in_its_last_chunk(ours: Client, system: str) -> None:
    """``stream_options.include_usage`` through the ``openai`` package: the last chunk has the usage."""
    client = openai.OpenAI(base_url=f"{ours.base_url}/v1", api_key="unused")
    messages: list[Any] = [{"role": "system", "content": system}, {"role": "user", "content": "Streamed?"}]
    ours.chat([*messages[:1], {"role": "user", "content": "Warm the system turn."}], **GREEDY)
    chunks = list(client.chat.completions.create(model="polykv", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    system_turn = len(ours.prompt_tokens(ours.apply_template(messages[:1], add_generation_prompt=False)))
    assert usage.prompt_tokens_details.cached_tokens is not None
    assert system_turn <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    # a share from the warm slot, or that slot reused: either way the last chunk says so
    assert (chunks[-1].model_extra or {})["shared_prefix"]["status"] in {"hit", "own_cache"}


def test_serve_upstream_is_the_stock_server_with_the_same_slots_and_template(logs: Path) -> None:
    """``polykv serve --upstream``: the pristine server (it knows none of polykv's flags), as many slots as
    ``polykv serve`` gives (pools + agent slots), the same template."""
    with polykv_serve("--upstream", "--agent-slots", "3", "--auto-pools", "2", "--log-dir", str(logs),
                      "--", "-c", "4096", "-t", "1") as (url, _):  # fmt: skip
        props = Client(url).props()
        assert props["total_slots"] == 5
        assert props["chat_template_caps"]["supports_tools"] is True
        assert "polykv" not in props  # the pristine server: no polykv section in /props

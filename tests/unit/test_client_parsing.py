"""Client parsing without a server: SSE, Prometheus metrics, stream aggregation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polykv_py.client import (
    SSEDecoder,
    aggregate,
    aggregate_completion,
    aggregate_oai,
    aparse_sse,
    error_message,
    parse_metrics,
    parse_sse,
)
from polykv_py.tokens import common_prefix_len


def sse(*events: object, done: bool = False) -> list[str]:
    lines: list[str] = []
    for ev in events:
        lines += [f"data: {json.dumps(ev)}", ""]
    if done:
        lines += ["data: [DONE]", ""]
    return lines


def test_sse_events_pings_and_done() -> None:
    lines = [":", "", *sse({"a": 1}), "event: message", *sse({"b": 2}), "data: [DONE]", "", *sse({"c": 3})]
    assert list(parse_sse(lines)) == [{"a": 1}, {"b": 2}]


def test_sse_multiline_data_and_missing_final_blank_line() -> None:
    lines = ['data: {"a":', "data: 1}", "", 'data: {"b": 2}']
    assert list(parse_sse(lines)) == [{"a": 1}, {"b": 2}]


def test_sse_crlf_and_no_space_after_colon() -> None:
    assert list(parse_sse(['data:{"x": "y"}\r', "\r"])) == [{"x": "y"}]


def test_sse_decoder_done_flag() -> None:
    dec = SSEDecoder()
    assert dec.feed("data: [DONE]") is None
    assert dec.feed("") is None
    assert dec.done


@given(st.lists(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=20), max_size=4), max_size=8))
def test_sse_roundtrip(events: list[dict[str, object]]) -> None:
    assert list(parse_sse(sse(*events, done=True))) == events


METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1234
llamacpp:prompt_seconds_total 5.5
llamacpp:kv_cache_usage_ratio NaN
http_requests{method="post",path="/completion"} 7 1700000000
"""


def test_parse_metrics() -> None:
    m = parse_metrics(METRICS)
    assert m["llamacpp:prompt_tokens_total"] == 1234.0
    assert m["llamacpp:prompt_seconds_total"] == 5.5
    assert m["llamacpp:kv_cache_usage_ratio"] != m["llamacpp:kv_cache_usage_ratio"]  # NaN
    assert m['http_requests{method="post",path="/completion"}'] == 7.0
    assert len(m) == 4


def test_error_message() -> None:
    body = json.dumps({"error": {"code": 400, "message": "bad prompt", "type": "invalid_request_error"}})
    assert error_message(body) == "bad prompt"
    assert error_message(b"plain text\n") == "plain text"
    assert error_message('{"error": "short"}') == "short"


def test_aggregate_completion_concatenates_and_keeps_final_fields() -> None:
    chunks = [
        {"content": "Hel", "tokens": [1], "stop": False, "completion_probabilities": [{"id": 1}]},
        {"content": "lo", "tokens": [2], "stop": False, "completion_probabilities": [{"id": 2}]},
        {
            "content": "",
            "tokens": [],
            "stop": True,
            "timings": {"prompt_n": 5},
            "shared_prefix": {"status": "hit", "shared": 4},
        },
    ]
    final = aggregate_completion(chunks)
    assert final["content"] == "Hello"
    assert final["tokens"] == [1, 2]
    assert final["completion_probabilities"] == [{"id": 1}, {"id": 2}]
    assert final["stop"] is True and final["timings"] == {"prompt_n": 5}
    assert final["shared_prefix"]["status"] == "hit"


def test_aggregate_chat_deltas() -> None:
    def chunk(delta: dict[str, object], finish: str | None = None, **top: object) -> dict[str, object]:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "id": "x", **top}

    chunks = [
        chunk({"role": "assistant", "content": None}),
        chunk({"content": "Hi"}),
        chunk({"content": " there"}),
        chunk({}, "length", timings={"predicted_n": 2}),
    ]
    chunks[1]["choices"][0]["logprobs"] = {"content": [{"token": "Hi"}]}  # type: ignore[index]
    final = aggregate_oai(chunks, chat=True)
    choice = final["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hi there"}
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"content": [{"token": "Hi"}]}
    assert final["timings"] == {"predicted_n": 2} and final["object"] == "chat.completion"


def test_aggregate_oai_text_two_choices() -> None:
    chunks = [
        {"choices": [{"index": 1, "text": "b", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "A", "finish_reason": "stop"}]},
        {"choices": [], "usage": {"completion_tokens": 3}},
    ]
    final = aggregate_oai(chunks, chat=False)
    assert [c["text"] for c in final["choices"]] == ["aA", "b"]
    assert final["choices"][0]["finish_reason"] == "stop"
    assert final["usage"] == {"completion_tokens": 3}


@pytest.mark.parametrize(
    ("a", "b", "n"), [([], [1], 0), ([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2), ([5], [6], 0)]
)
def test_common_prefix_len(a: list[int], b: list[int], n: int) -> None:
    assert common_prefix_len(a, b) == n


async def _alines(lines: list[str]) -> AsyncIterator[str]:
    for line in lines:
        yield line


@pytest.mark.parametrize(
    "lines",
    [
        [":", "", *sse({"a": 1}), "event: message", *sse({"b": 2}), "data: [DONE]", "", *sse({"c": 3})],
        ['data: {"a":', "data: 1}", "", 'data: {"b": 2}'],
        ['data:{"x": "y"}\r', "\r"],
        [],
    ],
)
def test_aparse_sse_is_parse_sse_over_async_lines(lines: list[str]) -> None:
    async def collect() -> list[dict[str, object]]:
        return [event async for event in aparse_sse(_alines(lines))]

    assert asyncio.run(collect()) == list(parse_sse(lines))


def test_aggregate_by_endpoint_copies_the_chunks() -> None:
    chunks = [{"content": "a", "tokens": [1], "timings": {"prompt_n": 1}}]
    final = aggregate("/completion", chunks)
    final["timings"]["prompt_n"] = 99
    assert chunks[0]["timings"] == {"prompt_n": 1}
    chat = [{"choices": [{"index": 0, "delta": {"content": "x"}}]}]
    assert aggregate("/v1/chat/completions", chat) == aggregate_oai(chat, chat=True)
    assert aggregate("/v1/completions", []) == {"choices": [], "object": "text_completion"}

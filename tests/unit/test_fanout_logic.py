"""Fan-out logic without a server: P, inputs, agents files, result arithmetic, stream parsing."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polykv_py.cli.run import finalize_agents, parse_agents
from polykv_py.fanout import Agent, BasePrompt, FanoutError, answer_text, chunk_has_text
from polykv_py.results import AgentResult, FanoutResult, PrimeResult, needs_reprime
from polykv_py.tokens import shared_prefix_len


# ---------------------------------------------------------------- P
def test_p_is_the_common_prefix_of_the_tokenized_prompts_not_the_base_length() -> None:
    # the design trap: the base alone ends in one "\n\n" token (271); inside the full prompt
    # the same characters are two "\n" tokens (198, 198)
    pool = [1, 2, 3, 271]
    agent = [1, 2, 3, 198, 198, 50, 51]
    assert shared_prefix_len(pool, agent) == 3


def test_p_leaves_at_least_one_token_to_compute() -> None:
    assert shared_prefix_len([1, 2, 3], [1, 2, 3]) == 2
    assert shared_prefix_len([1, 2, 3, 4], [1, 2]) == 1
    assert shared_prefix_len([], [1]) == 0
    assert shared_prefix_len([1], []) == 0


@given(st.lists(st.integers(0, 5), max_size=30), st.lists(st.integers(0, 5), max_size=30))
def test_p_is_a_verified_prefix_of_both(pool: list[int], agent: list[int]) -> None:
    p = shared_prefix_len(pool, agent)
    assert 0 <= p <= max(len(agent) - 1, 0)
    assert pool[:p] == agent[:p]


# ---------------------------------------------------------------- inputs
def test_base_context_is_text_or_messages() -> None:
    with pytest.raises(FanoutError):
        BasePrompt()
    with pytest.raises(FanoutError):
        BasePrompt(text="x", messages=({"role": "system", "content": "y"},))
    with pytest.raises(FanoutError):
        BasePrompt.from_text("")
    with pytest.raises(FanoutError):
        BasePrompt.chat()
    base = BasePrompt.chat(system="Be brief.", document="DOC")
    assert base.is_chat
    assert base.messages == ({"role": "system", "content": "Be brief.\n\nDOC"},)


def test_agent_prompts_and_messages() -> None:
    text = BasePrompt.from_text("DOC\n\n")
    chat = BasePrompt.chat(document="DOC")
    a = Agent("Q?")
    assert a.resolved_mode(text) == "completion"
    assert a.resolved_mode(chat) == "chat"
    assert a.prompt(text) == "DOC\n\nQ?"
    assert a.messages(chat) == [{"role": "system", "content": "DOC"}, {"role": "user", "content": "Q?"}]
    assert Agent("Q?", mode="chat").messages(text)[0] == {"role": "system", "content": "DOC\n\n"}
    with pytest.raises(FanoutError):
        a.prompt(chat)
    with pytest.raises(FanoutError):
        Agent("Q", mode="bogus").resolved_mode(text)  # type: ignore[arg-type]


def test_parse_agents_text_json_jsonl() -> None:
    agents = parse_agents("# comment\nFirst?\n\n  Second?  \n")
    assert [a.instructions for a in agents] == ["First?", "Second?"]
    doc = [{"name": "g", "prompt": "Goals?", "temperature": 0.7, "seed": 7}, "Plain?"]
    agents = parse_agents(json.dumps(doc), "json")
    assert agents[0].name == "g" and agents[0].params == {"temperature": 0.7, "seed": 7}
    assert agents[1].instructions == "Plain?"
    agents = parse_agents('{"prompt": "A", "mode": "completion", "params": {"n_predict": 4}}\n\n"B"\n', "jsonl")
    assert agents[0].mode == "completion" and agents[0].params == {"n_predict": 4}
    assert agents[1].instructions == "B"
    with pytest.raises(FanoutError):
        parse_agents('[{"name": "x"}]', "json")
    with pytest.raises(FanoutError):
        parse_agents('{"prompt": "x"}', "json")


def test_finalize_agents_sets_names_length_and_sampling_under_own_params() -> None:
    chat = BasePrompt.chat(document="D")
    text = BasePrompt.from_text("D")
    out = finalize_agents(
        [Agent("a"), Agent("b", name="bee", params={"temperature": 0.9, "max_tokens": 5})],
        chat,
        max_tokens=64,
        sampling={"temperature": 0.0},
    )
    assert out[0].name == "agent-1" and out[0].params == {"temperature": 0.0, "max_tokens": 64}
    assert out[1].name == "bee" and out[1].params == {"temperature": 0.9, "max_tokens": 5}
    out = finalize_agents([Agent("a")], text, max_tokens=8, sampling={})
    assert out[0].mode == "completion" and out[0].params == {"n_predict": 8}


# ---------------------------------------------------------------- stream parsing
def test_chunk_has_text_and_answer_text() -> None:
    assert chunk_has_text({"content": "Hi", "tokens": [1]}, "completion")
    assert not chunk_has_text({"content": "", "tokens": [], "stop": True}, "completion")
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}
    assert not chunk_has_text(role_only, "chat")
    assert chunk_has_text({"choices": [{"index": 0, "delta": {"content": "x"}}]}, "chat")
    assert answer_text({"content": "abc", "stop_type": "limit"}, "completion") == ("abc", "limit")
    final = {"choices": [{"message": {"role": "assistant", "content": "yo"}, "finish_reason": "length"}]}
    assert answer_text(final, "chat") == ("yo", "length")


def test_reprime_statuses() -> None:
    assert needs_reprime("not_resident") and needs_reprime("mismatch") and needs_reprime("inexact")
    assert not any(needs_reprime(s) for s in ("hit", "own_cache", "pool_busy", "unsupported", "self"))


# ---------------------------------------------------------------- result arithmetic
def _agent(i: int, status: str, n_prompt: int, p: int, processed: int, gen: int) -> AgentResult:
    return AgentResult(
        index=i,
        name=f"a{i}",
        mode="completion",
        text="",
        status=status,
        requested=p,
        shared=p,
        n_prompt=n_prompt,
        processed=processed,
        cached=n_prompt - processed,
        n_generated=gen,
        ttft_s=0.1,
        latency_s=1.0,
        started_s=0.0,
        finished_s=1.0,
        finish_reason="limit",
        id_slot=1,
    )


def test_fanout_result_numbers() -> None:
    agents = [_agent(0, "hit", 110, 100, 10, 4), _agent(1, "own_cache", 112, 100, 12, 4)]
    res = FanoutResult(
        agents=agents,
        primes=[PrimeResult(1, 101, 101, 0.5, "initial")],
        pool_slot=0,
        pool_tokens=101,
        wall_s=2.0,
        shared=True,
    )
    assert res.prefix_tokens == 100
    assert res.tokens_processed == 101 + 10 + 12
    assert res.tokens_without_sharing == 222
    assert res.kv_cells_without_sharing == 222 + 8
    assert res.kv_cells_with_sharing == 101 + (10 + 4) + (12 + 4)
    assert res.statuses == {"hit": 1, "own_cache": 1}
    doc = res.to_json()
    assert doc["tokens_processed"] == 123 and len(doc["agents"]) == 2
    json.dumps(doc)
    assert agents[0].prefix_reused and agents[1].prefix_reused
    assert not _agent(2, "not_resident", 110, 100, 110, 4).prefix_reused


# ---------------------------------------------------------------- command line
def _parser():  # type: ignore[no-untyped-def]
    import argparse

    from polykv_py.cli.run import register

    parser = argparse.ArgumentParser(prog="polykv")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_register_adds_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from polykv_py.cli.run import _collect_agents

    agents_file = tmp_path / "agents.txt"
    agents_file.write_text("# c\nOne?\nTwo?\n")
    args = _parser().parse_args(["run", "--base", "doc.md", "Zero?", "-a", str(agents_file), "--json", "-n", "16"])
    assert args.command == "run" and args.json and args.max_tokens == 16 and args.mode == "chat"
    assert [a.instructions for a in _collect_agents(args)] == ["Zero?", "One?", "Two?"]
    args = _parser().parse_args(["run", "--mode", "completion", "Q"])
    assert _collect_agents(args)[0].instructions == "\n\nQuestion: Q\nAnswer:"


def test_polykv_bench_hands_its_arguments_to_the_checkouts_benchmark(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import bench.fanout
    from polykv_py.cli import app

    args, rest = app.build_parser().parse_known_args(["bench", "--quick", "--n", "1", "2"])
    assert args.command == "bench" and rest == ["--quick", "--n", "1", "2"]
    seen = {}
    monkeypatch.setattr(bench.fanout, "main", lambda argv, prog: seen.update(argv=argv, prog=prog) or 0)
    assert app.main(["bench", "--quick", "--n", "1", "2"]) == 0
    assert seen == {"argv": ["--quick", "--n", "1", "2"], "prog": "polykv bench"}
    with pytest.raises(SystemExit) as exc:  # other commands still refuse what they do not know
        app.main(["run", "--quick"])
    assert exc.value.code == 2


def test_polykv_bench_outside_a_checkout_says_where_benchmarks_run(monkeypatch, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from polykv_py.cli import app
    from polykv_py.cli.bench import NOT_A_CHECKOUT

    for name in ("bench", "bench.fanout"):  # import bench fails as in an installed wheel
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.chdir(tmp_path)
    assert app.main(["bench", "--quick"]) == 2
    assert NOT_A_CHECKOUT in capsys.readouterr().err and "python -m bench.fanout" in NOT_A_CHECKOUT


def test_bench_quick_config() -> None:
    from bench.fanout import parse_args

    cfg = parse_args(["--quick", "--out", "x"])
    assert cfg is not None and sorted(cfg.ns) == [1, 2, 4, 8] and cfg.ps == [2048] and cfg.capacity
    cfg = parse_args(["--n", "16", "--p", "512", "--systems", "patched", "--no-capacity"])
    assert cfg is not None and cfg.ns == [16] and cfg.ps == [512] and cfg.systems == ["patched"] and not cfg.capacity


def test_first_line_drops_the_server_log_tail() -> None:
    from polykv_py.errors import ServerUnavailableError, first_line

    exc = ServerUnavailableError("request timed out", log_tail="a\nb")
    assert first_line(exc) == "request timed out"

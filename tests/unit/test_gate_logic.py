"""Gate comparison and verdict logic, without a server."""

from __future__ import annotations

from pathlib import Path

import pytest

from polykv_py.harness import gate
from polykv_py.harness.answers import SHARE_FIELDS, VOLATILE_FIELDS, compare, first_difference, strip_fields
from polykv_py.harness.gate import (
    Sharer,
    _sharer_verdict,
    build_base,
    default_output_cases,
    first_token_logprob_diff,
)


def answer(content: str, **extra: object) -> dict[str, object]:
    return {
        "content": content,
        "id_slot": 1,
        "timings": {"cache_n": 3, "prompt_n": 5, "prompt_ms": 1.5, "predicted_ms": 9.0},
        "created": 1,
        **extra,
    }


def test_volatile_fields_are_removed_and_nothing_else() -> None:
    a, b = answer("x"), answer("x", created=2)
    b["timings"]["prompt_ms"] = 99.0  # type: ignore[index]
    assert compare(a, b, VOLATILE_FIELDS, VOLATILE_FIELDS) == (True, "")
    c = answer("x")
    c["timings"]["cache_n"] = 4  # type: ignore[index]
    ok, diff = compare(a, c, VOLATILE_FIELDS, VOLATILE_FIELDS)
    assert not ok and diff == "$.timings.cache_n: 3 != 4"


def test_extra_field_or_order_is_a_difference() -> None:
    ok, diff = compare(answer("x", shared_prefix={"status": "hit"}), answer("x"), VOLATILE_FIELDS, VOLATILE_FIELDS)
    assert not ok and "shared_prefix" in diff
    ok, _ = compare(
        answer("x", shared_prefix={"status": "hit"}), answer("x"), VOLATILE_FIELDS + SHARE_FIELDS, VOLATILE_FIELDS
    )
    assert ok
    assert "order differs" in first_difference({"a": 1, "b": 2}, {"b": 2, "a": 1})


def test_stream_chunks_are_stripped_one_by_one() -> None:
    chunks = [{"id": "a", "choices": []}, {"id": "b", "created": 5, "choices": [1]}]
    assert strip_fields(chunks, VOLATILE_FIELDS) == [{"choices": []}, {"choices": [1]}]
    assert chunks[0]["id"] == "a"  # the input is not modified


def test_a_list_of_answers_and_streams_is_stripped_answer_by_answer() -> None:
    session = [answer("x"), [{"id": "a", "content": "y"}, {"id": "b", "timings": {"prompt_ms": 1.0, "prompt_n": 2}}]]
    assert strip_fields(session) == [
        {"content": "x", "id_slot": 1, "timings": {"cache_n": 3, "prompt_n": 5}},
        [{"content": "y"}, {"timings": {"prompt_n": 2}}],
    ]
    assert compare(session, strip_fields(session)) == (True, "")


def test_first_token_logprob_diff() -> None:
    def probs(*pairs: tuple[int, float]) -> dict[str, object]:
        return {"completion_probabilities": [{"top_logprobs": [{"id": i, "logprob": lp} for i, lp in pairs]}]}

    assert first_token_logprob_diff(probs((1, -0.5), (2, -1.0)), probs((2, -1.25), (3, -2.0))) == 0.25
    assert first_token_logprob_diff({}, probs((1, 0.0))) is None


def test_build_base_ends_with_blank_line_and_reaches_size() -> None:
    def fake_tokenize(text: str) -> list[int]:
        return [0] * (len(text) // 4)

    base = build_base(fake_tokenize, 500)
    assert base.endswith("\n\n") and len(fake_tokenize(base)) >= 500
    assert base == build_base(fake_tokenize, 500)  # deterministic


def sharer(p: int = 100, n_prompt: int = 120) -> Sharer:
    return Sharer(1, 1, "prompt", p, list(range(n_prompt)), {})


def test_verdict_hit() -> None:
    hit = {
        "shared_prefix": {"pool_slot": 0, "requested": 100, "shared": 100, "status": "hit"},
        "timings": {"prompt_n": 20},
    }
    assert _sharer_verdict(hit, sharer(), "hit")[0]
    hit["timings"] = {"prompt_n": 120}
    ok, why, _ = _sharer_verdict(hit, sharer(), "hit")
    assert not ok and "expected n_prompt - shared = 20" in why
    hit["timings"] = {"prompt_n": 20}
    hit["shared_prefix"]["shared"] = 99  # type: ignore[index]
    ok, why, _ = _sharer_verdict(hit, sharer(), "hit")
    assert not ok and "expected requested=100 shared=100" in why


def test_verdict_whole_prompt_share_reports_p_minus_one() -> None:
    """P == n_prompt: the server recomputes the last prompt token for its logits, so it reports shared = P - 1
    and processes one token (docs/shared-prefix.md "Response field"; server-polykv.cpp polykv_share_run)."""
    sent = {
        "shared_prefix": {"pool_slot": 0, "requested": 120, "shared": 119, "status": "hit"},
        "timings": {"prompt_n": 1},
    }
    ok, why, _ = _sharer_verdict(sent, sharer(120, 120), "hit")
    assert ok and why == "hit, shared 119, processed 1 = 120 - 119"
    # the shape the server never sends at a whole-prompt share
    never = {
        "shared_prefix": {"pool_slot": 0, "requested": 120, "shared": 120, "status": "hit"},
        "timings": {"prompt_n": 1},
    }
    ok, why, _ = _sharer_verdict(never, sharer(120, 120), "hit")
    assert not ok and "shared=120, expected requested=120 shared=119" in why
    sent["timings"] = {"prompt_n": 0}
    ok, why, _ = _sharer_verdict(sent, sharer(120, 120), "hit")
    assert not ok and "expected n_prompt - shared = 1" in why


def test_verdict_missing_field_and_miss() -> None:
    ok, why, _ = _sharer_verdict({"timings": {"prompt_n": 120}}, sharer(), "hit")
    assert not ok and "no shared_prefix field" in why
    miss = {"shared_prefix": {"requested": 100, "shared": 0, "status": "not_resident"}, "timings": {"prompt_n": 120}}
    assert _sharer_verdict(miss, sharer(), "not_resident")[0]
    ok, why, _ = _sharer_verdict(miss, sharer(), "hit")
    assert not ok and "not_resident" in why


def test_default_output_cases_cover_the_matrix() -> None:
    cases = default_output_cases(8, 3)
    names = {c.name for c in cases}
    for kind in ("completion", "chat"):
        for sampling in ("greedy", "seeded"):
            for mode in ("plain", "stream"):
                assert f"{kind}/{sampling}/{mode}" in names
    assert sum(1 for c in cases if c.group) >= 3
    assert not any("shared_pool_slot" in c.body for c in cases)


def test_server_args_reach_every_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--server-args`` (e.g. ``-ngl 99`` for a GPU backend) is split as a shell would and appended to the
    arguments of every server the gate starts, the patched and the reference alike."""
    args = gate.build_parser().parse_args(["--server-args", "-ngl 99 --device 'Vulkan0'"])
    assert args.server_args == "-ngl 99 --device 'Vulkan0'"
    started: list[tuple[str, list[str]]] = []

    class FakeServer:
        def __init__(self, binary: Path, model: Path, argv: list[str], **kw: object) -> None:
            started.append((str(kw["kind"]), argv))

        def start(self) -> FakeServer:
            return self

        def command(self, port: int) -> list[str]:
            return ["x", "-m", "m", *started[-1][1]]

        port, log_path = 1, Path("log")

    monkeypatch.setattr(gate, "LlamaServer", FakeServer)
    monkeypatch.setattr(gate, "resolve_model", lambda m: tmp_path / "m.gguf")
    cfg = gate.GateConfig(patched_bin=tmp_path / "p", upstream_bin=tmp_path / "u", server_args=("-ngl", "99"))
    servers = gate._Servers(cfg)
    for kind in ("patched", "upstream"):
        servers.start(kind, ["-np", "4"], kind)
    assert [argv for _, argv in started] == [["-np", "4", "-ngl", "99"]] * 2
    assert gate.GateConfig().server_args == ()

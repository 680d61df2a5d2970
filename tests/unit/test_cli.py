"""The polykv command line: dispatch and argument handling (no server started)."""

from __future__ import annotations

import pytest

from polykv_py.cli import app as cli
from polykv_py.harness import gate
from polykv_py.presets import SERVE_DEFAULTS


def test_gate_options_reach_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(gate, "run_from_args", lambda args: seen.append((str(args.report), args.sharers)) or 7)
    assert cli.main(["gate", "--report", "r.json", "--sharers", "2"]) == 7
    assert seen == [("r.json", 2)]


def test_serve_defaults_keep_the_pool_resident() -> None:
    for flag in ("-kvu", "--no-clear-idle"):
        assert flag in SERVE_DEFAULTS
    assert SERVE_DEFAULTS[SERVE_DEFAULTS.index("--cache-ram") + 1] == "0"


def test_unknown_command_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["no-such-command"])
    assert exc.value.code == 2

"""Launcher defaults that keep a server private: loopback binding, the API key passed through and
never logged (no server is started here; tests/integration/test_security.py checks the running server)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from polykv_py.cli import app as cli
from polykv_py.errors import ServerError
from polykv_py.server import LlamaServer, _redact

KEY = "sk-polykv-unit-0123456789"


def test_llama_server_binds_loopback_by_default(tmp_path: Path, fake_model: Path) -> None:
    srv = LlamaServer(tmp_path / "llama-server", fake_model)
    assert srv.host == "127.0.0.1" and srv.api_key is None
    cmd = srv.command(8080)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "--api-key" not in cmd


def test_llama_server_passes_the_api_key_and_redacts_it(tmp_path: Path, fake_model: Path) -> None:
    srv = LlamaServer(tmp_path / "llama-server", fake_model, ["-c", "512"], api_key=KEY)
    cmd = srv.command(8080)
    assert cmd[cmd.index("--api-key") + 1] == KEY
    shown = _redact(cmd)
    assert KEY not in " ".join(shown) and shown[shown.index("--api-key") + 1] == "***"


def test_start_log_line_redacts_the_key(tmp_path: Path, fake_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    exe = tmp_path / "fake-server"
    exe.write_text("#!/bin/sh\nexit 3\n")
    exe.chmod(0o755)
    srv = LlamaServer(exe, fake_model, api_key=KEY, log_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="polykv_py.server"), pytest.raises(ServerError):
        srv.start(timeout=10)
    assert "--api-key ***" in caplog.text and KEY not in caplog.text


@pytest.fixture
def exec_calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """`polykv serve` up to its execv: the command it would run."""
    import polykv_py.models
    import polykv_py.native

    calls: list[list[str]] = []
    monkeypatch.setattr(polykv_py.native, "server_binary", lambda kind="patched": tmp_path / f"llama-server-{kind}")
    monkeypatch.setattr(polykv_py.models, "resolve_model", lambda model=None: tmp_path / "m.gguf")
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append(list(argv)))
    monkeypatch.delenv("POLYKV_API_KEY", raising=False)
    return calls


def value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_serve_binds_loopback_unless_told_otherwise(
    exec_calls: list[list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    assert cli.main(["serve"]) == 0
    assert value(exec_calls[-1], "--host") == "127.0.0.1" and "--api-key" not in exec_calls[-1]
    assert "reachable from other machines" not in caplog.text
    with caplog.at_level(logging.WARNING):
        assert cli.main(["serve", "--host", "0.0.0.0"]) == 0
    assert value(exec_calls[-1], "--host") == "0.0.0.0"
    assert "binding 0.0.0.0: reachable from other machines with no API key" in caplog.text


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("/tmp/s.sock", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.5", False),
        ("127.0.0.1,0.0.0.0", False),
        ("example.org", False),
    ],
)
def test_loopback_detection(host: str, loopback: bool) -> None:
    assert cli._is_loopback(host) is loopback


def test_serve_passes_the_api_key_and_never_logs_it(
    exec_calls: list[list[str]], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with caplog.at_level(logging.INFO):
        assert cli.main(["serve", "--api-key", KEY]) == 0
    assert value(exec_calls[-1], "--api-key") == KEY
    assert "--api-key ***" in caplog.text and KEY not in caplog.text
    monkeypatch.setenv("POLYKV_API_KEY", KEY)  # read when the parser is built
    with caplog.at_level(logging.INFO):
        assert cli.main(["serve", "--host", "0.0.0.0"]) == 0
    assert value(exec_calls[-1], "--api-key") == KEY and KEY not in caplog.text
    assert "binding 0.0.0.0: reachable from other machines" in caplog.text and "no API key" not in caplog.text

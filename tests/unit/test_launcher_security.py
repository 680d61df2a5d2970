"""The launcher (`polykv serve`, LlamaServer) without a model: a fake llama-server (a small Python HTTP
server written to tmp_path) stands in for the binary.

Security: loopback binding by default, the API key passed through and never logged.
Lifecycle: pools primed (pinned, in order, salted) before "ready" is printed, SIGTERM/SIGINT stop the
child gracefully, a child that dies makes serve exit with its status and log tail.
tests/integration/test_security.py and test_openai_dropin.py check the running real server."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from polykv_py.cli import app as cli
from polykv_py.errors import ServerError
from polykv_py.llama_server import LlamaServer, _redact, free_port
from polykv_py.serve import is_loopback

KEY = "sk-polykv-unit-0123456789"

FAKE_SERVER = """\
#!{python}
# A stand-in for llama-server: --help, /health, /props, /apply-template, /completion; records what it gets.
# FAKE_POOL_FILES: /props names pool files, /tokenize answers, a restore is a miss (no such file) and a save
# succeeds, or fails as a full disk would with FAKE_SAVE_FAIL.
import json, os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
if "--help" in argv:
    print("--pool-slots N[,N...]   reserve these slots")
    if os.environ.get("FAKE_POOL_AUTO"):
        print("--pool-auto, --no-pool-auto   plain requests share the reserved pools")
    sys.exit(0)
record = open(os.environ["FAKE_RECORD"], "a")
def note(**kw):
    record.write(json.dumps(kw) + "\\n"); record.flush()
note(argv=argv, pid=os.getpid())
def opt(name, default):
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1] if name in argv else default
t0 = time.monotonic()
load_s = float(os.environ.get("FAKE_LOAD_S", "0.3"))

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def answer(self, code, doc):
        data = json.dumps(doc).encode()
        self.send_response(code); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        note(path=self.path, auth=self.headers.get("Authorization"))
        if time.monotonic() - t0 < load_s:
            return self.answer(503, {{"error": {{"message": "Loading model", "code": 503}}}})
        if self.path == "/health":
            return self.answer(200, {{"status": "ok"}})
        props = {{"total_slots": int(opt("-np", "4"))}}
        if os.environ.get("FAKE_POOL_FILES"):
            props["polykv"] = {{"pool_slots": [0], "pool_auto": False, "pool_auto_min_tokens": 64,
                                "pool_files": {{"format": 3, "model": {{"sha256": "ab" * 32}}}}}}
        return self.answer(200, props)
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{{}}")
        note(path=self.path, body=body, auth=self.headers.get("Authorization"))
        if self.path == "/apply-template":
            text = "".join("<%s>%s</>" % (m["role"], m["content"]) for m in body["messages"])
            return self.answer(200, {{"prompt": text}})
        if self.path == "/tokenize":
            return self.answer(200, {{"tokens": [ord(c) for c in body["content"]]}})
        if self.path.endswith("action=restore"):
            why = "Unable to restore pool slot 0: no such file"
            return self.answer(400, {{"error": {{"message": why, "code": 400}}}})
        if self.path.endswith("action=save"):
            if os.environ.get("FAKE_SAVE_FAIL"):
                why = "Unable to save pool slot 0: cannot write the pool file: No space left on device"
                return self.answer(500, {{"error": {{"message": why, "code": 500}}}})
            return self.answer(200, {{"n_saved": 1}})
        print("fake: prompt of %d characters into slot %s" % (len(body["prompt"]), body.get("id_slot")), flush=True)
        return self.answer(200, {{"content": "", "tokens_evaluated": len(body["prompt"]), "timings": {{}}}})

def stop(signum, frame):
    print("fake: got signal %d, exiting" % signum, flush=True)
    note(signal=signum)
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
def die(code, why):
    print("fake: " + why, flush=True)
    os._exit(code)
if os.environ.get("FAKE_DIE_AFTER_S"):
    threading.Timer(float(os.environ["FAKE_DIE_AFTER_S"]), die, (3, "dying with status 3")).start()
if os.environ.get("FAKE_LIFETIME_S"):
    threading.Timer(float(os.environ["FAKE_LIFETIME_S"]), die, (0, "lifetime over")).start()
print("fake: listening on %s:%s" % (opt("--host", "?"), opt("--port", "?")), flush=True)
ThreadingHTTPServer((opt("--host", "127.0.0.1"), int(opt("--port", "8080"))), H).serve_forever()
"""


@pytest.fixture
def fake(tmp_path: Path, fake_model: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The fake llama-server as `polykv serve`'s binary; the model a fake GGUF; returns paths and a reader."""
    exe = tmp_path / "llama-server"
    exe.write_text(FAKE_SERVER.format(python=sys.executable))
    exe.chmod(0o755)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("POLYKV_SERVER_BIN", str(exe))
    monkeypatch.setenv("POLYKV_MODEL", str(fake_model))
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.setenv("FAKE_LIFETIME_S", "1.0")  # in-process serves end when the fake exits on its own
    monkeypatch.delenv("POLYKV_API_KEY", raising=False)

    def read() -> list[dict[str, Any]]:
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    return {"exe": exe, "record": record, "read": read, "logs": tmp_path / "logs", "tmp": tmp_path}


def argv_of(fake: dict[str, Any]) -> list[str]:
    """The command line of the last fake server started."""
    return [e["argv"] for e in fake["read"]() if "argv" in e][-1]


def value(cmd: list[str], flag: str) -> str:
    return cmd[len(cmd) - 1 - cmd[::-1].index(flag) + 1]


def serve(fake: dict[str, Any], *args: str) -> int:
    return cli.main(["serve", "--port", str(free_port()), "--log-dir", str(fake["logs"]), *args])


# ------------------------------------------------------------------------------ LlamaServer


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
    with caplog.at_level(logging.INFO, logger="polykv_py.llama_server"), pytest.raises(ServerError):
        srv.start(timeout=10)
    assert "--api-key ***" in caplog.text and KEY not in caplog.text


# ------------------------------------------------------------------------------ polykv serve: security


def test_serve_binds_loopback_unless_told_otherwise(fake: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    assert serve(fake) == 0
    assert value(argv_of(fake), "--host") == "127.0.0.1" and "--api-key" not in argv_of(fake)
    assert "reachable from other machines" not in caplog.text
    with caplog.at_level(logging.WARNING):
        assert serve(fake, "--host", "0.0.0.0") == 0  # reached on loopback by the launcher
    assert value(argv_of(fake), "--host") == "0.0.0.0"
    assert "binding 0.0.0.0: reachable from other machines with no API key" in caplog.text


def test_a_host_among_the_server_flags_is_the_one_bound_and_warned_about(
    fake: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert serve(fake, "--", "--host", "0.0.0.0") == 0
    cmd = argv_of(fake)
    assert cmd.count("--host") == 1 and value(cmd, "--host") == "0.0.0.0"
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
    assert is_loopback(host) is loopback


def test_serve_passes_the_api_key_and_never_logs_it(
    fake: dict[str, Any], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = fake["tmp"] / "doc.txt"
    doc.write_text("the shared document")
    with caplog.at_level(logging.INFO):
        assert serve(fake, "--api-key", KEY, "--pool", str(doc)) == 0
    assert value(argv_of(fake), "--api-key") == KEY
    assert "--api-key ***" in caplog.text and KEY not in caplog.text
    primes = [e for e in fake["read"]() if e.get("path") == "/completion"]
    assert primes and all(e["auth"] == f"Bearer {KEY}" for e in primes)  # the launcher primes with the key
    monkeypatch.setenv("POLYKV_API_KEY", KEY)  # read when the parser is built
    with caplog.at_level(logging.INFO):
        assert serve(fake, "--host", "0.0.0.0") == 0
    assert value(argv_of(fake), "--api-key") == KEY and KEY not in caplog.text
    assert "binding 0.0.0.0: reachable from other machines" in caplog.text and "no API key" not in caplog.text


# ------------------------------------------------------------------------------ polykv serve: pools


def test_pools_are_reserved_and_primed_pinned_in_order(fake: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    a, b = fake["tmp"] / "a.md", fake["tmp"] / "b.md"
    a.write_text("document A\n")
    b.write_text("document B")
    with caplog.at_level(logging.INFO):
        assert serve(fake, "--pool", str(a), "--pool-chat", str(b), "--pool", str(a), "--pool-salt", "team-a") == 0
    cmd = argv_of(fake)
    # 3 pools, 2 more for the prefixes --share-any promotes, 8 agent slots
    assert value(cmd, "--pool-slots") == "0,1,2,3,4" and value(cmd, "-np") == "13"
    assert "--pool-auto" not in cmd  # this fake's --help does not list it
    posts = [e for e in fake["read"]() if e.get("path") in ("/completion", "/apply-template")]
    assert [e["path"] for e in posts] == ["/completion", "/apply-template", "/completion", "/completion"]
    primes = [e["body"] for e in posts if e["path"] == "/completion"]
    assert [p["id_slot"] for p in primes] == [0, 1, 2]
    assert [p["prompt"] for p in primes] == ["document A\n", "<system>document B</>", "document A\n"]
    system_b = [{"role": "system", "content": "document B"}]
    assert posts[1]["body"] == {"messages": system_b, "add_generation_prompt": False}
    assert all(p["n_predict"] == 0 and p["cache_salt"] == "team-a" for p in primes)
    assert "pool slot 1: " + str(b) + " (chat), 21 tokens primed in" in caplog.text


def test_a_failed_pool_save_is_a_warning_and_the_pool_is_served(
    fake: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 26 item 7: the post-prime save fails (disk full): serve warns, names the pool and the reason, serves."""
    doc = fake["tmp"] / "doc.md"
    doc.write_text("document A")
    monkeypatch.setenv("FAKE_POOL_FILES", "1")
    monkeypatch.setenv("FAKE_SAVE_FAIL", "1")
    cache = fake["tmp"] / "pools"
    with caplog.at_level(logging.INFO):
        assert serve(fake, "--pool", str(doc), "--pool-salt", "team-a", "--pool-cache", str(cache)) == 0
    assert "polykv serve: ready at http://127.0.0.1:" in capsys.readouterr().out
    warning = [r for r in caplog.records if r.levelno == logging.WARNING and "could not save" in r.getMessage()]
    assert len(warning) == 1 and f"pool slot 0 ({doc})" in warning[0].getMessage()
    assert "No space left on device" in warning[0].getMessage()
    assert "priming the pools failed" not in caplog.text
    posts = {e["path"].split("?")[-1]: e["body"] for e in fake["read"]() if e.get("path", "").startswith("/slots/0")}
    assert posts["action=restore"]["cache_salt"] == "team-a" and posts["action=save"]["cache_salt"] == "team-a"
    assert posts["action=save"]["filename"] == posts["action=restore"]["filename"]
    primes = [e["body"] for e in fake["read"]() if e.get("path") == "/completion"]
    assert len(primes) == 1 and primes[0]["id_slot"] == 0 and primes[0]["cache_salt"] == "team-a"


def test_pool_auto_is_added_when_the_binary_knows_it(fake: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_POOL_AUTO", "1")
    assert serve(fake) == 0
    cmd = argv_of(fake)
    assert "--pool-auto" in cmd and value(cmd, "--pool-slots") == "0,1" and value(cmd, "-np") == "10"
    assert serve(fake, "--no-pool-auto", "--agent-slots", "3", "--auto-pools", "1") == 0
    assert "--pool-auto" not in argv_of(fake) and value(argv_of(fake), "-np") == "4"


def test_share_any_reserves_pools_for_promoted_prefixes_and_a_cache_for_them(fake: dict[str, Any]) -> None:
    cache = fake["tmp"] / "pools"
    assert serve(fake, "--pool-cache", str(cache), "--auto-pools", "3") == 0
    cmd = argv_of(fake)
    assert "--share-any" in cmd and value(cmd, "--pool-slots") == "0,1,2" and value(cmd, "-np") == "11"
    assert value(cmd, "--slot-save-path") == f"{cache}{os.sep}"
    # --no-share-any last: nothing is promoted, so no pools are added and no cache is needed without --pool
    assert serve(fake, "--pool-cache", str(cache), "--", "--no-share-any") == 0
    cmd = argv_of(fake)
    assert value(cmd, "--pool-slots") == "0" and value(cmd, "-np") == "9" and "--slot-save-path" not in cmd
    assert serve(fake, "--no-pool-cache") == 0
    assert value(argv_of(fake), "--pool-slots") == "0,1" and "--slot-save-path" not in argv_of(fake)


def test_no_defaults_keeps_only_what_the_pools_need(fake: dict[str, Any]) -> None:
    doc = fake["tmp"] / "doc.txt"
    doc.write_text("text")
    assert serve(fake, "--no-defaults") == 0
    cmd = argv_of(fake)
    assert not {"-kvu", "--pool-slots", "-np", "--metrics", "-t"} & set(cmd)
    assert serve(fake, "--no-defaults", "--pool", str(doc), "--", "-c", "1024") == 0
    cmd = argv_of(fake)
    assert value(cmd, "--pool-slots") == "0" and value(cmd, "-np") == "9" and value(cmd, "-c") == "1024"
    assert "-kvu" not in cmd


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--upstream", "--pool", "{doc}"], "the reference server (--upstream) has none"),
        (["--pool", "{doc}", "--", "--pool-slots", "3"], "drop --pool-slots"),
        (["--pool-salt", "s"], "give one"),
        (["--auto-pools", "-1"], "--auto-pools must be >= 0"),
        (["--pool", "{missing}"], "cannot read pool file"),
    ],
)
def test_pool_options_that_cannot_work_are_refused(
    fake: dict[str, Any], caplog: pytest.LogCaptureFixture, args: list[str], message: str
) -> None:
    doc = fake["tmp"] / "doc.txt"
    doc.write_text("text")
    argv = [a.format(doc=doc, missing=fake["tmp"] / "missing.txt") for a in args]
    assert serve(fake, *argv) == 1
    assert message in caplog.text
    assert not any("argv" in e for e in fake["read"]())  # nothing was started


# ------------------------------------------------------------------------------ polykv serve: lifecycle


def spawn_serve(fake: dict[str, Any], *args: str) -> subprocess.Popen[str]:
    """`polykv serve` in its own process (signals are sent to it), stdout and stderr merged."""
    env = {**os.environ, "FAKE_LIFETIME_S": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(cli.__file__).parents[2]), env.get("PYTHONPATH", "")])
    code = "import sys; from polykv_py.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, "serve", "--port", str(free_port()), "--log-dir", str(fake["logs"]), *args]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(proc: subprocess.Popen[str], marker: str, timeout: float = 30.0) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    proc.kill()
    raise AssertionError(f"no {marker!r} in the output:\n" + "\n".join(lines))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_ready_after_the_pools_and_a_signal_stops_the_child(fake: dict[str, Any], sig: signal.Signals) -> None:
    doc = fake["tmp"] / "doc.txt"
    doc.write_text("the shared document")
    proc = spawn_serve(fake, "--pool", str(doc))
    try:
        lines = read_until(proc, "polykv serve: ready at http://127.0.0.1:")
        pool_line = next(i for i, line in enumerate(lines) if "pool slot 0: " in line)
        assert pool_line < len(lines) - 1  # logged before the ready line
        child = next(e["pid"] for e in fake["read"]() if "pid" in e)
        assert psutil.pid_exists(child)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert {"signal": int(signal.SIGTERM)} in fake["read"]()  # the child was asked to stop, not killed
    assert f"{sig.name}: stopping llama-server" in out
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_a_child_that_dies_ends_serve_with_its_status_and_log_tail(
    fake: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_DIE_AFTER_S", "2")
    proc = spawn_serve(fake)
    try:
        read_until(proc, "ready at")
        out, _ = proc.communicate(timeout=30)  # the fake dies 2 s after it started
    finally:
        proc.kill()
    assert proc.returncode == 3, out
    assert "llama-server exited on its own with status 3" in out
    assert "--- server log tail ---" in out and "fake: dying with status 3" in out


def test_a_child_that_fails_to_start_ends_serve_with_its_status(
    fake: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FAKE_DIE_AFTER_S", "0.1")
    monkeypatch.setenv("FAKE_LOAD_S", "60")
    assert serve(fake) == 3
    assert "exited during startup (exit status 3)" in caplog.text and "fake: dying with status 3" in caplog.text

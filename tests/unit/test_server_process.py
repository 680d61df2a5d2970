"""LlamaServer process handling with stand-in scripts (no llama-server build needed)."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from polykv_py.errors import ServerError
from polykv_py.llama_server import LlamaServer, free_port, read_log_tail


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "fake-server"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_exit_during_start_reports_status_and_log(tmp_path: Path, fake_model: Path) -> None:
    exe = script(tmp_path, 'echo "args: $*"\necho "error: something is wrong" >&2\nexit 3\n')
    srv = LlamaServer(exe, fake_model, ["--flag", "x"], threads=2, log_dir=tmp_path)
    with pytest.raises(ServerError) as info:
        srv.start(timeout=30)
    assert info.value.exit_status == 3
    assert "something is wrong" in info.value.log_tail and "server log tail" in str(info.value)
    assert "--host 127.0.0.1" in info.value.log_tail and "-t 2" in info.value.log_tail
    assert info.value.log_tail.rstrip().endswith("something is wrong")
    assert not srv.is_alive() and srv.returncode == 3


def test_timeout_kills_the_whole_process_group(tmp_path: Path, fake_model: Path) -> None:
    exe = script(tmp_path, "sleep 600 &\necho child $!\nexec sleep 600\n")
    srv = LlamaServer(exe, fake_model, log_dir=tmp_path)
    with pytest.raises(ServerError, match="not ready after"):
        srv.start(timeout=1.0)
    child = int(srv.log_path.read_text().split("child ")[1].split()[0])
    deadline = time.monotonic() + 5
    while not (gone(srv.pid) and gone(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(srv.pid) and gone(child)


def test_missing_executable(tmp_path: Path, fake_model: Path) -> None:
    with pytest.raises(ServerError, match="cannot execute"):
        LlamaServer(tmp_path / "nope", fake_model, log_dir=tmp_path).start()


def test_unstarted_server_has_no_port(fake_model: Path, tmp_path: Path) -> None:
    srv = LlamaServer(tmp_path / "nope", fake_model)
    assert not srv.is_alive() and srv.stop() is None and srv.log_tail() == ""
    with pytest.raises(ServerError, match="not been started"):
        _ = srv.url


def test_read_log_tail_and_free_port(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert read_log_tail(log, 3) == "line 97\nline 98\nline 99"
    assert read_log_tail(tmp_path / "missing.log") == ""
    assert 0 < free_port() < 65536


FAKE_HTTP_SERVER = """#!{python}
import http.server, sys
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(b'{{"status": "ok"}}')
    def log_message(self, *a): pass
try:
    srv = http.server.HTTPServer((host, port), H)
except OSError as exc:
    print("couldn't bind HTTP server socket:", exc, flush=True); sys.exit(1)
print("listening", port, flush=True)
srv.serve_forever()
"""


def test_restart_after_a_kill_keeps_the_port_or_falls_back(tmp_path: Path, fake_model: Path) -> None:
    import os
    import signal
    import socket
    import sys

    exe = tmp_path / "fake-http-server"
    exe.write_text(FAKE_HTTP_SERVER.format(python=sys.executable))
    exe.chmod(0o755)
    srv = LlamaServer(exe, fake_model, log_dir=tmp_path).start(timeout=30)
    try:
        port, pid = srv.port, srv.pid
        os.kill(pid, signal.SIGKILL)
        srv.restart(timeout=30)  # reaps the dead process, same port: clients keep their URL
        assert srv.port == port and srv.pid != pid and srv.is_alive() and gone(pid)
        assert srv.health_state() == "ok"
        pid = srv.pid
        srv.stop()
        with socket.socket() as squatter:  # the old port was taken meanwhile: a new one, not a failure
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            srv.restart(timeout=30)
        assert srv.port != port and srv.is_alive() and srv.health_state() == "ok" and gone(pid)
    finally:
        srv.stop()

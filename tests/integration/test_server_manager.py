"""LlamaServer and Client against the real binary and the real default model."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from polykv_py.errors import HTTPError, ServerError, ServerUnavailableError
from polykv_py.llama_server import LlamaServer

pytestmark = pytest.mark.integration

N_PREDICT = 8


@pytest.fixture(scope="module")
def server(
    patched_server_bin: Path, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    logs = tmp_path_factory.mktemp("server-logs")
    with LlamaServer(patched_server_bin, model_path, ["-c", "2048", "-np", "2"], log_dir=logs, name="mgr") as srv:
        yield srv


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_start_health_and_identity(server: LlamaServer) -> None:
    assert server.is_alive() and server.health_state() == "ok"
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert server.client.health() == {"status": "ok"}
    assert "-t 2" in " ".join(server.command(server.port))
    conns = [c for c in psutil.Process(server.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert conns and all(c.laddr.ip == "127.0.0.1" for c in conns)
    assert server.log_path.is_file() and "model loaded" in server.log_tail(200)


def test_endpoints(server: LlamaServer) -> None:
    c = server.client
    props = c.props()
    assert Path(props["model_path"]).name == server.model.name
    assert len(c.slots()) == 2
    toks = c.tokenize("Hello world", add_special=False)
    assert c.detokenize(toks) == "Hello world"
    pieces = c.tokenize("Hello world", with_pieces=True)
    assert [p["id"] for p in pieces] == toks and "".join(p["piece"] for p in pieces) == "Hello world"
    prompt = c.apply_template([{"role": "user", "content": "Hi"}])
    assert "Hi" in prompt
    res = c.completion("The capital of France is", n_predict=N_PREDICT, temperature=0, n_probs=2, return_tokens=True)
    assert res["tokens_predicted"] == N_PREDICT and len(res["completion_probabilities"]) == N_PREDICT
    stream = c.completion_stream("The capital of France is", n_predict=N_PREDICT, temperature=0)
    assert stream.final["content"] == res["content"] and stream.final["tokens"] == res["tokens"]
    assert len(res["tokens"]) == N_PREDICT
    assert stream.chunks[-1]["stop"] is True
    chat = c.chat([{"role": "user", "content": "Say hi"}], max_tokens=N_PREDICT, temperature=0)
    chat_stream = c.chat_stream([{"role": "user", "content": "Say hi"}], max_tokens=N_PREDICT, temperature=0)
    assert chat_stream.final["choices"][0]["message"]["content"] == chat["choices"][0]["message"]["content"]
    oai = c.oai_completion("1, 2, 3,", max_tokens=N_PREDICT, temperature=0)
    oai_stream = c.oai_completion_stream("1, 2, 3,", max_tokens=N_PREDICT, temperature=0)
    assert oai_stream.final["choices"][0]["text"] == oai["choices"][0]["text"]
    metrics = c.metrics()
    assert metrics["llamacpp:tokens_predicted_total"] >= N_PREDICT


def test_http_error_message(server: LlamaServer) -> None:
    with pytest.raises(HTTPError) as info:
        server.client.completion("x", n_predict=2, id_slot=0, n_probs="many")
    assert 400 <= info.value.status < 600 and info.value.server_message


def test_async_client_concurrent(server: LlamaServer) -> None:
    async def main() -> list[str]:
        async with server.async_client() as ac:
            results = await asyncio.gather(
                *(ac.completion(f"Count: {i},", n_predict=N_PREDICT, temperature=0) for i in range(2))
            )
            return [r["content"] for r in results]

    assert len(asyncio.run(main())) == 2


def test_usage(server: LlamaServer) -> None:
    u = server.usage()
    assert u.n_processes >= 1 and u.rss_bytes > 50 * 2**20 and u.cpu_s > 0


def test_bad_flag_raises_with_exit_status_and_log(patched_server_bin: Path, model_path: Path, tmp_path: Path) -> None:
    srv = LlamaServer(patched_server_bin, model_path, ["--no-such-flag"], log_dir=tmp_path)
    with pytest.raises(ServerError) as info:
        srv.start(timeout=60)
    assert info.value.exit_status not in (None, 0)
    assert "--no-such-flag" in info.value.log_tail
    assert "server log tail" in str(info.value)
    assert not srv.is_alive()


def test_bad_model_raises_with_exit_status_and_log(patched_server_bin: Path, tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    srv = LlamaServer(patched_server_bin, bad, log_dir=tmp_path)
    with pytest.raises(ServerError) as info:
        srv.start(timeout=60)
    assert info.value.exit_status not in (None, 0)
    assert "model" in info.value.log_tail.lower()
    assert gone(srv.pid)


def test_start_timeout_stops_the_process(patched_server_bin: Path, model_path: Path, tmp_path: Path) -> None:
    srv = LlamaServer(patched_server_bin, model_path, log_dir=tmp_path)
    with pytest.raises(ServerError, match="not ready after"):
        srv.start(timeout=0.01)
    assert gone(srv.pid)


def test_port_in_use(patched_server_bin: Path, model_path: Path, tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        srv = LlamaServer(patched_server_bin, model_path, port=port, log_dir=tmp_path)
        with pytest.raises(ServerError) as info:
            srv.start(timeout=60)
    assert "bind" in info.value.log_tail


def test_sigkill_leaves_no_orphan_and_client_reports(
    patched_server_bin: Path, model_path: Path, tmp_path: Path
) -> None:
    srv = LlamaServer(patched_server_bin, model_path, ["-c", "512"], log_dir=tmp_path).start()
    pid = srv.pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while srv.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not srv.is_alive() and srv.health_state() == "dead"
    with pytest.raises(ServerUnavailableError) as info:
        srv.client.health()
    assert info.value.exit_status == -signal.SIGKILL and "model loaded" in info.value.log_tail
    assert srv.stop() == -signal.SIGKILL
    assert gone(pid)


def test_graceful_stop(patched_server_bin: Path, model_path: Path, tmp_path: Path) -> None:
    srv = LlamaServer(patched_server_bin, model_path, ["-c", "512"], log_dir=tmp_path).start()
    pid = srv.pid
    t0 = time.monotonic()
    status = srv.stop(timeout=30)
    assert status == 0, srv.log_tail()
    assert time.monotonic() - t0 < 30 and gone(pid)
    assert "cleaning up" in srv.log_tail(20)
    assert srv.stop() == 0  # idempotent


def test_api_key(patched_server_bin: Path, model_path: Path, tmp_path: Path) -> None:
    with LlamaServer(patched_server_bin, model_path, ["-c", "512"], api_key="s3cret", log_dir=tmp_path) as srv:
        assert srv.client.props()["model_path"]
        from polykv_py.client import Client

        with Client(srv.url) as anon, pytest.raises(HTTPError) as info:
            anon.props()
        assert info.value.status == 401
        assert srv.client.health() == {"status": "ok"}  # /health stays public


def test_finalizer_kills_an_unreferenced_server(patched_server_bin: Path, model_path: Path, tmp_path: Path) -> None:
    srv = LlamaServer(patched_server_bin, model_path, ["-c", "512"], log_dir=tmp_path).start()
    pid = srv.pid
    del srv
    gc.collect()
    assert gone(pid)


def test_server_dies_with_a_killed_parent(patched_server_bin: Path, model_path: Path, tmp_path: Path) -> None:
    """Even SIGKILL of the Python process that started it (no finalizer runs) takes the server down."""
    code = (
        "import sys, time\nfrom polykv_py.llama_server import LlamaServer\n"
        "s = LlamaServer(sys.argv[1], sys.argv[2], ['-c', '512'], log_dir=sys.argv[3]).start()\n"
        "print(s.pid, flush=True)\ntime.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(patched_server_bin), str(model_path), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        assert line.strip().isdigit(), f"child did not start a server: {line!r}"
        pid = int(line)
        assert not gone(pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid)

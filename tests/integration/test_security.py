"""What a pool server exposes, and to whom (docs/security.md), on the real patched llama-server.

- With an API key every endpoint but /health answers 401 to a request without it (or with a wrong
  one): completions with pool fields, /slots and its erase action, /metrics, /props, /tokenize.
  polykv's clients and the fan-out send the key they were given.
- /slots shows token counts and sampling parameters per slot, not prompt texts (those only with
  LLAMA_SERVER_SLOTS_DEBUG=1 in the server's environment).
- The key is not in polykv's log lines nor in llama-server's log; it is in the process's command line.
- --no-slots turns /slots off; the CORS default lets any web origin read an unkeyed server's answers.
- shared_pool_slot may name any slot: nothing is shared without the same tokens, but ``common`` tells
  how many leading tokens matched (a prefix oracle).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from polykv_py.client import Client, Share
from polykv_py.errors import HTTPError
from polykv_py.fanout import Agent, BasePrompt, run_fanout
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import pool_server

pytestmark = pytest.mark.integration

BASE = "Confidential plan: the launch code name is Blue Heron and the budget is 42 units.\n"


@pytest.fixture(scope="module")
def key() -> str:
    return "sk-polykv-" + secrets.token_hex(12)


@pytest.fixture(scope="module")
def secured(
    patched_server_bin: Path, model_path: Path, key: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LlamaServer, str]]:
    logs = tmp_path_factory.mktemp("security-logs")
    caplog_handler = _Capture()
    logger = logging.getLogger("polykv_py.llama_server")
    logger.addHandler(caplog_handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    env = {"LLAMA_SERVER_SLOTS_DEBUG": "0"}  # whatever this environment says: /slots without prompt texts
    server = pool_server(binary=patched_server_bin, model=model_path, n_agents_parallel=2, ctx=512, threads=1,
                         track_kv=False, api_key=key, env=env, log_dir=logs, name="secured")  # fmt: skip
    try:
        with server as srv:
            yield srv, caplog_handler.text()
    finally:
        logger.removeHandler(caplog_handler)
        logger.setLevel(old_level)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def text(self) -> str:
        return "\n".join(self.lines)


PROTECTED: list[tuple[str, str, dict[str, Any] | None]] = [
    (
        "POST",
        "/completion",
        {"prompt": BASE + "Q?", "n_predict": 1, "shared_pool_slot": 0, "shared_prefix_n_tokens": 8},
    ),
    (
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "shared_pool_slot": 0,
            "shared_prefix_n_tokens": 8,
        },
    ),
    ("GET", "/slots", None),
    ("POST", "/slots/0?action=erase", {}),
    ("GET", "/metrics", None),
    ("GET", "/props", None),
    ("POST", "/tokenize", {"content": BASE}),
]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=[f"{m} {p}" for m, p, _ in PROTECTED])
@pytest.mark.parametrize("who", ["no key", "wrong key"])
def test_requests_without_the_key_are_401(
    secured: tuple[LlamaServer, str], method: str, path: str, body: dict[str, Any] | None, who: str
) -> None:
    srv, _ = secured
    with Client(srv.url, api_key=None if who == "no key" else "sk-wrong") as anon, pytest.raises(HTTPError) as info:
        anon.request(method, path, body)
    assert info.value.status == 401 and info.value.server_message == "Invalid API Key"
    assert srv.is_alive()


def test_the_key_holder_shares_and_the_key_stays_out_of_logs(secured: tuple[LlamaServer, str], key: str) -> None:
    srv, polykv_log = secured
    with Client(srv.url) as anon:
        assert anon.health() == {"status": "ok"}  # /health stays public (readiness probes)
    agents = [
        Agent("Q: what is the code name? A:", params={"n_predict": 2, "temperature": 0.0}),
        Agent("Q: what is the budget? A:", params={"n_predict": 2, "temperature": 0.0}),
    ]
    res = run_fanout(BasePrompt.from_text(BASE), agents, server=srv)  # the server's key, passed through
    assert [a.status for a in res.agents] == ["hit", "hit"], res.statuses
    # /slots (key holders only) shows each slot's token count, sampling parameters and activity, not the
    # prompt text: llama-server adds that only with LLAMA_SERVER_SLOTS_DEBUG=1 in its environment
    slots = srv.client.slots()
    pool = next(s for s in slots if s["id"] == 0)
    assert pool["n_prompt_tokens"] == res.pool_tokens and "prompt" not in pool
    assert "Blue Heron" not in json.dumps(slots)
    assert "--api-key ***" in polykv_log and key not in polykv_log
    assert key not in srv.log_path.read_text(errors="replace")
    assert key in psutil.Process(srv.pid).cmdline()  # visible to local users (ps): docs/security.md


def test_no_slots_and_the_cors_default(patched_server_bin: Path, model_path: Path, tmp_path: Path) -> None:
    """--no-slots turns /slots off. And loopback is not private from a web browser: llama-server's CORS
    default reflects any Origin, so a page from any site can call an unkeyed local server and read the
    answer (--cors-origins localhost or an API key closes that; docs/security.md)."""
    with LlamaServer(
        patched_server_bin,
        model_path,
        ["-c", "256", "-np", "2", "--no-slots"],
        threads=1,
        log_dir=tmp_path,
        name="no-slots",
    ) as srv:
        with pytest.raises(HTTPError) as info:
            srv.client.slots()
        assert info.value.status == 501 and "slots endpoint" in info.value.server_message
        with httpx.Client(base_url=srv.url, trust_env=False) as http:
            resp = http.post("/tokenize", json={"content": "hi"}, headers={"Origin": "https://evil.example"})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "https://evil.example"
        assert "CORS allows all origins" in srv.log_tail(200)


def test_only_reserved_pools_are_sources_and_a_salted_pool_tells_nothing(secured: tuple[LlamaServer, str]) -> None:
    """With --pool-slots, naming another client's slot as a pool is a 400 (before patch 0074 it answered
    with ``common``, a prefix oracle over that slot's cache), and a salted pool answers another salt with
    ``salt_mismatch`` and nothing about its contents (docs/security.md)."""
    srv, _ = secured
    c = srv.client
    private = "User B private: my locker code is 7314 and I leave at noon."
    c.prime(private, 2)  # client B's conversation in slot 2 (not a pool)
    guess = "User B private: my locker code is 1111 and"
    g_tokens = c.prompt_tokens(guess)
    c.erase_slot(1)  # client A's slot: no cache of its own
    with pytest.raises(HTTPError) as exc:
        c.completion(guess, id_slot=1, n_predict=1, share=Share(2, len(g_tokens)))
    assert exc.value.status == 400 and "shared_pool_slot" in str(exc.value)
    # the reserved pool, primed under a salt: another salt learns nothing of what it holds
    c.completion(private, id_slot=0, n_predict=1, cache_salt="tenant-b")
    c.erase_slot(1)
    res = c.completion(guess, id_slot=1, n_predict=1, share=Share(0, len(g_tokens)), cache_salt="tenant-a")
    assert res["shared_prefix"] == {"pool_slot": 0, "requested": len(g_tokens), "shared": 0, "status": "salt_mismatch"}
    assert res["timings"]["prompt_n"] == len(g_tokens)  # computed itself: nothing of B's KV was used
    c.erase_slot(1)
    same = c.completion(private + " Q:", id_slot=1, n_predict=1, share=Share(0), cache_salt="tenant-b")
    assert same["shared_prefix"]["status"] == "hit"  # the same salt, and B's exact tokens

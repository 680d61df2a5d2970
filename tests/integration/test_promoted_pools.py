"""Promoted prefixes outlive the server: ``polykv serve`` (no ``--pool``, ``--share-any`` on) saves the pool a
shared prefix was promoted into to its pool cache, and restores it at the next start.

The real launcher runs in its own process (the official ``openai`` package talks to it), small: 2 agent slots,
1 promotion pool, 4,096 cells, 2 threads.

- run 1: two plain chat requests with one ~400-token system message, one after the other: the second shares the
  first's prefix from its agent slot, the server promotes it into the reserved pool, and the launcher saves that
  pool once as ``auto-<hash>.pkvpool`` (a file of the pool's tokens, for this model);
- a concurrent salted pair is shared and promoted too (it replaces the idle promoted pool), but nothing of it is
  written (the launcher holds no salt): the launcher's own log (``-v``: httpx's line per request, time-stamped)
  shows it looking at the pools three times after that, and asking for no save;
- run 2 on the same cache: the launcher says it restored one promoted prefix, ``/slots`` shows the pool
  promoted, resident, restored from that file, with the saved tokens; a first request with the system message
  computes only its own suffix (``cached_tokens`` >= the system message, shared from the pool) and answers as run
  1 did under the layout margins of :mod:`polykv_py.harness.compare`.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from serve_process import REQUEST_LINE, polykv_serve

from polykv_py.client import Client
from polykv_py.data import sample_document
from polykv_py.harness.compare import compare_chat
from polykv_py.harness.texts import repeat_to_tokens
from polykv_py.pools import POOL_FILE_SUFFIX, PROMOTED_FILE_PREFIX
from polykv_py.prefix_file import read_prefix_header

pytestmark = pytest.mark.integration

SYSTEM_TOKENS = 400
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 5}
SERVER_FLAGS = ("-c", "4096", "-t", "2", "-b", "256", "-ub", "256")
SAVE_WAIT_S = 20.0  # the launcher looks at the pools every 2 s


def serve_args(model: Path, cache: Path, logs: Path) -> list[str]:
    """The launcher's arguments here: the model, the pool cache, 2 agent slots and 1 auto pool, small batches."""
    return ["--model", str(model), "--pool-cache", str(cache), "--agent-slots", "2", "--auto-pools", "1",
            "--log-dir", str(logs), "--", *SERVER_FLAGS]  # fmt: skip


def requests_since(lines: list[str], t0: float) -> list[tuple[float, str, str]]:
    """The launcher's requests logged after ``t0`` (time.time()): (time, method, path), in order."""
    found = []
    for line in list(lines):
        if (m := REQUEST_LINE.match(line)) and float(m["t"]) > t0:
            found.append((float(m["t"]), m["method"], m["path"]))
    return found


def wait_for_looks(lines: list[str], t0: float, n: int) -> list[tuple[float, str, str]]:
    """The launcher's requests after ``t0`` up to its ``n``-th look at the pools (``GET /slots``: a
    look's only request, :meth:`~polykv_py.promoted.PromotedPoolKeeper.poll`), or all of them after a while."""
    deadline = time.monotonic() + n * SAVE_WAIT_S
    while time.monotonic() < deadline:
        found = requests_since(lines, t0)
        looks = [i for i, (_, method, path) in enumerate(found) if (method, path) == ("GET", "/slots")]
        if len(looks) >= n:
            return found[: looks[n - 1] + 1]
        time.sleep(0.2)
    return requests_since(lines, t0)


def ask(url: str, system: str, question: str, **extra: Any) -> dict[str, Any]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    resp = client.chat.completions.create(model="m", messages=messages, **GREEDY, **extra)  # type: ignore[call-overload]
    return resp.model_dump()  # type: ignore[no-any-return]


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def promoted_files(cache: Path) -> list[Path]:
    return sorted(cache.glob(f"{PROMOTED_FILE_PREFIX}*{POOL_FILE_SUFFIX}"))


def wait_for_files(cache: Path, n: int) -> list[Path]:
    deadline = time.monotonic() + SAVE_WAIT_S
    while len(files := promoted_files(cache)) < n and time.monotonic() < deadline:
        time.sleep(0.5)
    return files


def test_a_promoted_prefix_is_saved_and_restored_at_the_next_start(model_path: Path, tmp_path: Path) -> None:
    cache, logs = tmp_path / "pools", tmp_path / "logs"
    with polykv_serve(*serve_args(model_path, cache, logs)) as (url, lines):
        with Client(url) as c:
            system = repeat_to_tokens(sample_document(), SYSTEM_TOKENS, c.tokenize, c.detokenize)
            n_sys = len(c.prompt_tokens(c.apply_template([{"role": "system", "content": system}])))
        first = ask(url, system, "Agent 0: what is point 0?")
        second = ask(url, system, "Agent 1: what is point 1?")
        assert cached(second) >= n_sys and second["shared_prefix"]["auto"] == "any", second["usage"]
        files = wait_for_files(cache, 1)
        assert len(files) == 1, f"the promoted pool was not saved: {os.listdir(cache)}"
        header = read_prefix_header(files[0])
        assert header["n_tokens"] >= n_sys and not header.get("salt_mac")
        with Client(url) as c:
            pool = c.pools()[0]
        assert pool.promoted and pool.tokens_sha256 == header["tokens_sha256"]

        # a salted pair, concurrent (one at a time, the second would extend the first's slot and share nothing),
        # is promoted too and replaces the idle promoted pool, but only a holder of the salt could save it
        salted = {"extra_body": {"cache_salt": "tenant-a"}}
        with ThreadPoolExecutor(2) as pool_exec:
            pair = list(
                pool_exec.map(lambda i: ask(url, "Tenant A.\n" + system, f"Agent {i}: point {i}?", **salted), (2, 3))
            )
        assert max(cached(a) for a in pair) >= n_sys, [a["usage"] for a in pair]
        with Client(url) as c:
            assert c.metrics()["llamacpp:polykv_share_promoted_total"] >= 2
            pool = c.pools()[0]
        assert pool.promoted and pool.salted is True and pool.tokens_sha256 is None
        # the launcher looks at the pools (GET /slots) every 2 s, one look at a time: the second look logged after
        # the salted pool was seen in place was sent after it and saw it, and the third shows that that look
        # had ended (a save would have been requested in between)
        seen = time.time()
        sent = wait_for_looks(lines, seen, 3)
        assert [r[1:] for r in sent].count(("GET", "/slots")) == 3, f"the launcher did not look 3 times: {sent}"
        assert all(method == "GET" for _, method, _ in sent), f"the launcher tried to save the salted pool: {sent}"
        assert promoted_files(cache) == files

    with polykv_serve(*serve_args(model_path, cache, logs)) as (url, lines):
        assert any("1 promoted prefix restored" in line for line in lines), lines
        with Client(url) as c:
            pool = c.pools()[0]
            before = c.metrics()["llamacpp:prompt_tokens_total"]
        assert pool.promoted and pool.resident and pool.restored_from == files[0].name
        assert pool.tokens_sha256 == header["tokens_sha256"] and pool.n_tokens == header["n_tokens"]
        again = ask(url, system, "Agent 0: what is point 0?")
        with Client(url) as c:
            spent = c.metrics()["llamacpp:prompt_tokens_total"] - before
        assert cached(again) >= n_sys and again["shared_prefix"]["pool_slot"] == 0, again["usage"]
        assert spent == again["usage"]["prompt_tokens"] - cached(again)
        a, b = first["choices"][0], again["choices"][0]
        cmp = compare_chat(a, b)
        assert cmp.ok, f"{cmp.detail}: {a['message']['content']!r} vs {b['message']['content']!r}"

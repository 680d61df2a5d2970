"""The pool cache: a base computed once, restored after a restart (fan-out API and ``polykv run``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polykv_py.fanout import Agent, BasePrompt, Fanout
from polykv_py.pools import PoolCache
from polykv_py.presets import pool_server

pytestmark = pytest.mark.integration

BASE = "\n".join(f"Fact {i}: the depot at gate {i} stores {i * 11 % 89} barrels of oil." for i in range(60))
AGENTS = [Agent(f"Question: how many barrels does the depot at gate {g} store? Answer:") for g in (3, 17, 42)]
GEN = {"n_predict": 8, "temperature": 0}


async def fan_out(url: str, cache: PoolCache) -> tuple[list[str], list[int], list[str | None]]:
    async with Fanout.connect(url, BasePrompt.from_text(BASE), pool_cache=cache, concurrency=1) as ctx:
        agents = [Agent(a.instructions, params=GEN) for a in AGENTS]
        res = await ctx.run(agents)
    # one at a time on 2 agent slots: a later agent may find the base in its slot from an earlier share
    statuses = [a.status for a in res.agents]
    assert statuses[0] == "hit" and set(statuses) <= {"hit", "own_cache"}, statuses
    return [a.text for a in res.agents], [p.processed for p in res.primes], [p.restored_from for p in res.primes]


def test_fanout_restores_after_a_restart(tmp_path: Path) -> None:
    cache = PoolCache(tmp_path / "pools")
    srv = pool_server(n_agents_parallel=2, ctx=4096, track_kv=False, slot_save_path=cache.save_path, log_dir=tmp_path)
    srv.start()
    try:
        first, processed, restored = asyncio.run(fan_out(srv.url, cache))
        assert restored == [None] and processed[0] > 0
        (entry,) = cache.entries()
        assert entry.n_tokens == processed[0] and entry.name.startswith("pool-")
        srv.restart()
        second, processed2, restored2 = asyncio.run(fan_out(srv.url, cache))
    finally:
        srv.stop()
    assert restored2 == [entry.name] and processed2 == [0]
    assert second == first


def run_cli(args: list[str], cache_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "POLYKV_CACHE_DIR": str(cache_dir)}
    cli = "import sys; from polykv_py.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", cli, "run", *args], capture_output=True, text=True, env=env, timeout=600, check=False
    )


def test_polykv_run_twice_restores_the_second_time(tmp_path: Path, model_path: Path) -> None:
    """As a new user would: the same command twice; the second restores the base, says so, computes none of it."""
    base = tmp_path / "base.md"
    base.write_text(BASE)
    agents = tmp_path / "agents.txt"
    agents.write_text("\n".join(a.instructions for a in AGENTS) + "\n")
    cache_dir = tmp_path / "cache"
    args = ["--base", str(base), "--agents", str(agents), "--concurrency", "1", "--max-tokens", "8", "--json",
            "--no-kv", "--ctx", "4096", "--model", str(model_path)]  # fmt: skip
    runs = []
    for _ in range(2):
        out = run_cli(args, cache_dir)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append((json.loads(out.stdout), out.stderr))
    (doc1, err1), (doc2, err2) = runs
    assert "pool primed" in err1 and "saved to the pool cache" in err1
    assert "pool restored from the pool cache" in err2 and "no base token computed" in err2
    p1, p2 = doc1["result"]["primes"][0], doc2["result"]["primes"][0]
    assert p1["processed"] > 0 and p2["processed"] == 0 and p2["restored_from"] == p1["saved_to"]
    assert [a["text"] for a in doc2["result"]["agents"]] == [a["text"] for a in doc1["result"]["agents"]]
    assert len(PoolCache(cache_dir / "pools").entries()) == 1

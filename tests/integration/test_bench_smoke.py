"""The benchmark harness on real servers, at a size that runs in seconds (the numbers are not the point)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import multiturn, zeroconfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def base() -> str:
    return multiturn.base_for(200)


def test_multiturn_patched_shares_the_base_then_reuses_each_agents_own_transcript(base: str) -> None:
    cfg = multiturn.TurnsConfig(n=2, turns=2, p=200, gen=4, threads=1)
    cell = multiturn.run_cell("patched", cfg, base)
    first, second = cell["per_turn"]
    assert first["statuses"] == {"hit": 2} and first["n_errors"] == 0
    # turn 2: each agent's slot still holds base + its own first turn, so nothing of it is recomputed
    assert second["statuses"] == {"own_cache": 2} and second["n_errors"] == 0
    assert second["prompt_tokens_processed"] < 2 * (multiturn.QUESTION_TOKENS + cfg.gen)
    # the base is held once: peak cells stay under P + both transcripts
    assert cell["kv_cells_peak"] <= cfg.p + 2 * multiturn.own_cells(2, cfg.gen) + 16


def test_multiturn_stock_queued_runs_at_the_sharing_budget(base: str) -> None:
    cfg = multiturn.TurnsConfig(n=2, turns=2, p=200, gen=4, threads=1)
    cell = multiturn.run_cell("stock_queued", cfg, base)
    patched_cells, _ = multiturn.budget(multiturn.SYSTEMS["patched"], cfg)
    assert cell["ctx"] == patched_cells and cell["slots"] == 1
    assert all(t["n_errors"] == 0 and t["statuses"] == {"not_shared": 2} for t in cell["per_turn"])


def test_zeroconfig_plain_openai_requests_share_the_system_message_and_stay_above_the_bounds(tmp_path: Path) -> None:
    cfg = zeroconfig.ZeroConfig(
        n=2,
        prompt_tokens=200,
        max_tokens=4,
        ctx=2048,
        threads=1,
        tag="t",
        out_dir=tmp_path,
        systems=("polykv", "stock"),
    )
    doc = zeroconfig.run(cfg)
    polykv, stock = doc["runs"]["polykv"]["turns"], doc["runs"]["stock"]["turns"]
    for t in (*polykv, *stock):
        assert t["n_errors"] == 0 and t["prompt_token_mismatches"] == 0, t["errors"]
        # the bound is a lower bound: nothing computes fewer prompt tokens than a perfect prefix cache
        assert t["prompt_tokens_computed"] >= t["bound_resident_tokens"]
    # turn 1: no pool declared, yet one agent computes the system message and the other shares it
    assert polykv[0]["cached_ge_common"] == 1 and stock[0]["cached_ge_common"] == 0
    assert polykv[0]["prompt_tokens_computed"] < stock[0]["prompt_tokens_computed"]
    # turn 2 carries the same histories on both servers, so every answer is compared
    assert doc["history_from"] == "polykv"
    for turn in doc["comparison"]["stock"]["per_turn"][:2]:
        assert sum(turn["answers"]["verdicts"].values()) == 2 and turn["answers"]["verdicts"]["error"] == 0
    assert (tmp_path / "t.json").is_file() and (tmp_path / "t.md").is_file()

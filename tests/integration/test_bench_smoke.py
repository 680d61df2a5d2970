"""The benchmark harness on real servers, at a size that runs in seconds (the numbers are not the point)."""

from __future__ import annotations

import pytest

from bench import multiturn

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

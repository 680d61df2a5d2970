"""Load: agents in rounds over a reserved pool (the full 64-agent, 10-round run is bench/bench_reliability.py).

CI-sized: 4 agent slots, a 512-token pool, 12 agents, 2 rounds. Each round must have no
error, no prefix recomputed (a hit, or the slot's own copy of the shared cells), every answer
equal to its serial reference (identical, or a near-tie flip from cell-order rounding), and no
KV cell left behind.
"""

from __future__ import annotations

import pytest

from polykv_py.harness.loadtest import LoadConfig, run_load

pytestmark = pytest.mark.integration


def test_rounds_hold_without_errors_drift_or_leak(model_path: object) -> None:
    cfg = LoadConfig(n_slots=4, pool_tokens=512, n_agents=12, rounds=2, suffix_tokens=32, n_predict=8)
    report = run_load(cfg)
    assert report.pool_cells == 512
    assert len(report.rounds) == 2
    for r in report.rounds:
        assert r.errors == [], r.errors
        assert r.server_alive
        assert set(r.statuses) <= {"hit", "own_cache"} and sum(r.statuses.values()) == 12, r.statuses
        # a slot's first agent of the round takes the pool's cells; later agents on that slot find them in its
        # own cache (the server prefers the most similar idle slot, so not every slot is used)
        assert r.statuses.get("hit", 0) >= 1
        assert r.prefix_recomputed == [], r.prefix_recomputed
        assert r.different == [], r.different
        assert r.identical + r.near_tie == 12
        assert r.kv_cells_after_erase == r.kv_cells_pool == 512, "KV cells leaked"
    # most answers must be bit-identical: near ties are the exception, not the rule
    assert sum(r.identical for r in report.rounds) >= 18

"""Benchmark systems, KV budgets and the multi-turn report, without a server."""

from __future__ import annotations

import re
from typing import Any

from bench import multiturn
from bench.fanout import cell_budget
from bench.systems import STOCK, SYSTEMS, best_stock
from polykv_py.data.questions import QUESTIONS
from polykv_py.native import ServerKind


def test_every_stock_mode_is_the_pristine_server_and_polykv_modes_share() -> None:
    assert set(STOCK) == {"stock", "stock_kvu", "stock_cache", "stock_queued"}
    for name in STOCK:
        assert SYSTEMS[name].kind is ServerKind.UPSTREAM and not SYSTEMS[name].share
        assert "--pool-slots" not in SYSTEMS[name].flags
    assert SYSTEMS["stock"].flags == ()  # upstream's own defaults, nothing added
    assert SYSTEMS["patched"].unified and not SYSTEMS["copied"].unified
    assert SYSTEMS["patched"].share and SYSTEMS["copied"].share
    # drop-in: the server holds the pool, the agents send plain requests
    assert SYSTEMS["dropin"].pool and not SYSTEMS["dropin"].share and "--pool-auto" in SYSTEMS["dropin"].flags


def test_best_stock_names_the_fastest_stock_system_only() -> None:
    assert best_stock({"stock": 10.0, "stock_kvu": 12.0, "patched": 1.0}) == ("stock", 10.0)
    assert best_stock({"stock": None, "stock_queued": 3.0}) == ("stock_queued", 3.0)
    assert best_stock({"patched": 1.0}) is None


def test_cell_budgets() -> None:
    # N copies: a slot per agent plus one, each with room for a whole prompt
    cells, slots, flight = cell_budget("stock", 8, 2048, 64, 32)
    assert slots == 9 and flight == 8 and cells >= 9 * (2048 + 96)
    # sharing budget: the patched server keeps a slot per agent, the stock server fits one prompt and queues
    cells_p, slots_p, flight_p = cell_budget("patched", 8, 2048, 64, 32)
    cells_q, slots_q, flight_q = cell_budget("stock_queued", 8, 2048, 64, 32)
    assert cells_p == cells_q == 3072 and (slots_p, flight_p) == (9, 8) and (slots_q, flight_q) == (1, 1)


def test_turn_budgets_grow_with_the_transcript() -> None:
    one = multiturn.TurnsConfig(n=4, turns=1, p=2048)
    many = multiturn.TurnsConfig(n=4, turns=16, p=2048)
    shared_one, _ = multiturn.budget(SYSTEMS["patched"], one)
    shared_many, slots = multiturn.budget(SYSTEMS["patched"], many)
    assert shared_many - shared_one >= 4 * 15 * (multiturn.QUESTION_TOKENS + 32) - 256
    assert slots == 5
    cells, slots = multiturn.budget(SYSTEMS["stock_queued"], many)
    assert cells == shared_many and 1 <= slots < 4  # fewer whole transcripts than agents fit: they queue
    cells, slots = multiturn.budget(SYSTEMS["stock"], many)
    assert slots == 5 and cells >= 5 * (2048 + multiturn.own_cells(16, 32))


def test_questions_rotate_and_name_facts_of_the_document() -> None:
    from polykv_py.data import sample_document

    doc = sample_document()
    for question, fact in QUESTIONS:
        assert question.endswith("?") and fact in doc, fact
    blocks = {multiturn.question_block(a, t)[0] for a in range(4) for t in range(4)}
    assert len(blocks) == 16  # every agent asks something new every turn


def _cell(system: str, walls: list[float]) -> dict[str, Any]:
    per_turn = [
        {"wall_s": w, "prompt_tokens_processed": 100, "ttft_p50_s": 0.5, "ttft_p95_s": 0.9, "kv_cells_peak": 10}
        for w in walls
    ]
    return {
        "system": system,
        "n": 4,
        "turns": len(walls),
        "p": 2048,
        "per_turn": per_turn,
        "wall_s": sum(walls),
        "kv_cells_peak": 10,
    }


def test_turns_report_compares_with_the_best_stock_system_at_each_checkpoint() -> None:
    doc = {
        "config": {"gen": 32, "turns": 4},
        "machine": {"cpu": "test", "logical_cpus": 2, "load_avg_start": [0.1, 0.1, 0.1]},
        "systems": {k: SYSTEMS[k].label for k in ("stock", "stock_queued", "patched")},
        "cells": [_cell("stock", [10, 2, 2, 2]), _cell("stock_queued", [4, 4, 4, 4]), _cell("patched", [2, 1, 1, 1])],
    }
    md = re.sub(" +", " ", multiturn.markdown(doc))
    assert "## P = 2,048, N = 4" in md
    assert "| best stock | 4.0 (stock_queued) | 16.0 (stock) |" in md  # T=1: queued 4 s; T=4: stock 16 s
    assert "| patched x vs best stock | 2.00 | 3.20 |" in md

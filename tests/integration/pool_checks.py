"""Checks several model-family modules make of a pool server (test_swa, test_recurrent, test_attention_families)."""

from __future__ import annotations

from typing import Any

from polykv_py.client import Client
from polykv_py.harness.compare import compare_greedy
from polykv_py.llama_server import LlamaServer


def prime_pool(c: Client, prompt: str) -> int:
    """Fill reserved pool 0 with ``prompt``; the pool is resident with all its tokens. Returns their number."""
    c.erase_slot(0)
    c.prime(prompt, 0)
    n = len(c.prompt_tokens(prompt))
    (pool,) = c.pools()
    assert pool.resident and pool.n_tokens == n, pool
    return n


def outcomes(c: Client, status: str) -> float:
    """``polykv_share_outcomes_total`` for ``status``."""
    return c.metrics().get(f'llamacpp:polykv_share_outcomes_total{{status="{status}"}}', 0.0)


def assert_like_reference(ref: LlamaServer, prompt: str, got: dict[str, Any], gen: dict[str, Any]) -> None:
    """``got`` equals the reference server's answer computing the whole ``prompt`` on an emptied slot 0 (token
    for token, logprobs within :func:`~polykv_py.harness.compare.compare_greedy`'s default margins)."""
    with Client(ref.url) as rc:
        rc.erase_slot(0)
        theirs = rc.completion(prompt, id_slot=0, **gen)
    assert theirs["timings"]["cache_n"] == 0
    cmp = compare_greedy(got, theirs)
    assert cmp.ok, f"{cmp.detail}: {got['content']!r} vs {theirs['content']!r}"

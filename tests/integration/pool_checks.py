"""Checks several model-family modules make of a pool server (test_swa, test_recurrent, test_attention_families)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.multiturn import question_block
from polykv_py.client import Client, Share
from polykv_py.data import sample_document
from polykv_py.harness.compare import compare_greedy
from polykv_py.harness.texts import cut_to_tokens
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import SHARED_DECODE, pool_server


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


def sharers_at_once(
    model: Path, logs: Path, *, shared_decode: bool, n: int, gen: dict[str, Any], ctx: int = 4096
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A fresh pool server (flash attention on, ``--shared-decode`` if asked) with its pool primed with 500 tokens of
    the sample document, then ``n`` sharers (the pool's prompt and a question each) in one multi-prompt request, so
    that every run batches them alike. Returns the answers (each asserted a ``hit``) and ``/props``."""
    extra = ["-fa", "on", *([SHARED_DECODE] if shared_decode else [])]
    srv = pool_server(model=model, n_agents_parallel=n, ctx=ctx, threads=2, extra_args=extra, track_kv=False,
                      log_dir=logs, name=f"{model.stem}-sd-{'on' if shared_decode else 'off'}")  # fmt: skip
    with srv:
        c = srv.client
        base = cut_to_tokens(sample_document(), 500, c.tokenize, c.detokenize)
        c.prime(base, 0)
        answers = c.completion([base + question_block(i, 0)[0] for i in range(n)], share=Share(0), **gen)
        props = c.props()
    assert isinstance(answers, list) and [a["shared_prefix"]["status"] for a in answers] == ["hit"] * n, answers
    return answers, props

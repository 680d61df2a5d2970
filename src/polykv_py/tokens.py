"""Token-list arithmetic behind every share: common prefixes and the P a sharer may ask for."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def longest_common_prefix(lists: Sequence[Sequence[int]]) -> int:
    """Length of the longest run of leading tokens that every list in ``lists`` shares (0 for none)."""
    if not lists:
        return 0
    n = min(len(x) for x in lists)
    first = lists[0]
    for i in range(n):
        t = first[i]
        if any(x[i] != t for x in lists[1:]):
            return i
    return n


def shared_prefix_len(pool_tokens: Sequence[int], prompt_tokens: Sequence[int]) -> int:
    """P for one sharer: the common prefix of the *tokenized* pool prompt and the tokenized prompt.

    Capped at ``len(prompt_tokens) - 1``, because the server must compute at least one token.
    Never ``len(tokenize(base))``: a token at the seam may tokenize differently (``docs/fanout.md``).
    """
    return max(0, min(common_prefix_len(pool_tokens, prompt_tokens), len(prompt_tokens) - 1))

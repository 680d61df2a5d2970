"""Plain types and pure helpers of the shared-prefix engine (no native code needed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from .llama.params import ContextParams, SamplingParams
from .tokens import longest_common_prefix

Tokenization = Literal["joint", "separate"]


@dataclass(frozen=True)
class GenerationParams:
    """When each agent stops, and how it samples (greedy by default).

    Agent ``i`` samples with ``sampling.seed + i``, so a seeded run is reproducible
    and agent ``i`` alone (``run_alone(..., agent_index=i)``) draws the same numbers.
    """

    max_tokens: int = 32
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, not {self.max_tokens!r}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a tuple of non-empty strings")


def split_joint(prefix_alone: Sequence[int], fulls: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """Split jointly tokenized prompts into a shared prefix and per-agent suffixes.

    The shared part is the longest common leading run of ``fulls``, at most
    ``len(prefix_alone)`` tokens, and short enough that every agent keeps one token.
    """
    if not fulls:
        raise ValueError("no prompts")
    p = min(longest_common_prefix(fulls), len(prefix_alone), min(len(f) for f in fulls) - 1)
    p = max(p, 0)
    return list(fulls[0][:p]), [list(f[p:]) for f in fulls]


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest stop string in ``text``, or -1."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def needed_cells(n_prefix: int, suffix_lens: Sequence[int], max_tokens: int, *, share: bool, kv_unified: bool) -> int:
    """KV cells a run needs at most (the prefix once when shared with unified KV)."""
    agents = sum(s + max_tokens for s in suffix_lens)
    n = len(suffix_lens)
    if share and kv_unified:
        return n_prefix + agents
    if share:
        return (n + 1) * n_prefix + agents  # whole-sequence copies, one per stream
    return n * n_prefix + agents


def _pad256(n: int) -> int:
    return -(-n // 256) * 256


def context_params_for(
    n_agents: int,
    prefix_len: int,
    suffix_len: int,
    max_tokens: int,
    *,
    share: bool = True,
    kv_unified: bool = True,
    base: ContextParams | None = None,
) -> ContextParams:
    """Context settings with room for ``n_agents`` agents of the given sizes (sequence 0 = prefix)."""
    if n_agents < 1:
        raise ValueError("n_agents must be >= 1")
    if kv_unified:
        cells = needed_cells(prefix_len, [suffix_len] * n_agents, max_tokens, share=share, kv_unified=True)
        n_ctx = _pad256(cells + 16)
    else:  # one stream per sequence, each of n_ctx / n_seq_max cells (libllama pads it to 256)
        n_ctx = (n_agents + 1) * _pad256(prefix_len + suffix_len + max_tokens + 16)
    return replace(base or ContextParams(), n_ctx=n_ctx, n_seq_max=n_agents + 1, kv_unified=kv_unified)

"""Plain settings objects (no native code needed to build or validate them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FlashAttn = Literal["auto", "on", "off"]

#: libllama's LLAMA_MAX_SEQ at the pinned commit (``llama_max_parallel_sequences()``).
LLAMA_MAX_SEQ = 256


@dataclass(frozen=True)
class ContextParams:
    """Context settings. ``n_threads=None`` uses every CPU; ``kv_unified`` shares one KV
    buffer between all sequences (required for zero-copy ``seq_cp`` of a prefix)."""

    n_ctx: int = 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    n_seq_max: int = 1
    kv_unified: bool = True
    n_threads: int | None = None
    n_threads_batch: int | None = None
    flash_attn: FlashAttn = "auto"
    no_perf: bool = False

    def validate(self, max_seq: int = LLAMA_MAX_SEQ) -> None:
        """Raise ``ValueError`` for settings libllama would reject or abort on."""
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 2**31:
                raise ValueError(f"{name} must be a positive int, not {v!r}")
        if self.n_seq_max > max_seq:
            raise ValueError(f"n_seq_max={self.n_seq_max} exceeds libllama's limit of {max_seq}")
        for name in ("n_threads", "n_threads_batch"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or >= 1, not {v!r}")
        if self.flash_attn not in ("auto", "on", "off"):
            raise ValueError(f"flash_attn must be 'auto', 'on' or 'off', not {self.flash_attn!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` is greedy (argmax).

    Otherwise the chain is top-k (if ``top_k > 0``) -> top-p (if ``top_p < 1``) ->
    temperature -> a random draw seeded with ``seed``.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), not {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if not 0 <= self.seed < 2**32 - 1:
            raise ValueError(f"seed must be in [0, 2**32 - 1), not {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self, seed: int) -> SamplingParams:
        """The same settings with another seed (wrapped into the valid range)."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, seed % (2**32 - 1))

"""A token batch for ``llama_decode`` that owns its ``llama_batch`` arrays."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Self

from .._ffi import lib
from ..errors import LlamaError, SequenceError, TokenError
from ._check import check_ptr

if TYPE_CHECKING:
    from types import TracebackType

_INT32_MAX = 2**31 - 1


class Batch:
    """Up to ``capacity`` tokens, each with an explicit position, sequence ids and output flag.

    Python-side bookkeeping (largest token / sequence id, outputs) lets
    :meth:`Context.decode` validate the batch before libllama sees it.
    """

    def __init__(self, capacity: int, *, max_seqs_per_token: int = 1) -> None:
        if not 0 < capacity <= _INT32_MAX:
            raise ValueError(f"batch capacity must be positive, not {capacity}")
        if not 0 < max_seqs_per_token <= 256:
            raise ValueError(f"max_seqs_per_token must be in [1, 256], not {max_seqs_per_token}")
        self.capacity = capacity
        self.max_seqs_per_token = max_seqs_per_token
        self._b: Any = lib.llama_batch_init(capacity, 0, max_seqs_per_token)
        check_ptr(self._b.token, f"llama_batch_init({capacity})")
        self._owned = True
        self.clear()

    # -- ownership ------------------------------------------------------------------
    def close(self) -> None:
        if self._owned:
            lib.llama_batch_free(self._b)
            self._owned = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_owned", False):
            self.close()

    @property
    def struct(self) -> Any:
        """The ``llama_batch`` value to pass to ``llama_decode``."""
        if not self._owned:
            raise LlamaError("the batch is closed")
        return self._b

    # -- content --------------------------------------------------------------------
    def clear(self) -> None:
        """Empty the batch (keeps its allocation)."""
        self._b.n_tokens = 0
        self.max_token = -1
        self.max_seq_id = -1
        self.outputs: list[int] = []
        self.seq_ids_used: set[int] = set()
        self.multi_seq_tokens = 0

    def __len__(self) -> int:
        return int(self._b.n_tokens)

    @property
    def n_tokens(self) -> int:
        return int(self._b.n_tokens)

    def add(self, token: int, pos: int, seq_ids: int | Sequence[int], logits: bool = False) -> int:
        """Append one token; returns its index in the batch (the index for its logits)."""
        if not self._owned:
            raise LlamaError("the batch is closed")
        i = int(self._b.n_tokens)
        if i >= self.capacity:
            raise LlamaError(f"the batch is full ({self.capacity} tokens)")
        ids = (seq_ids,) if isinstance(seq_ids, int) else tuple(seq_ids)
        if not ids or len(ids) > self.max_seqs_per_token:
            raise SequenceError(f"a token needs 1 to {self.max_seqs_per_token} sequence ids, got {len(ids)}")
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= _INT32_MAX:
            raise TokenError(f"invalid token id {token!r}")
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos <= _INT32_MAX:
            raise SequenceError(f"invalid position {pos!r} (positions are ints >= 0)")
        b = self._b
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = len(ids)
        row = b.seq_id[i]
        for k, s in enumerate(ids):
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= _INT32_MAX:
                raise SequenceError(f"invalid sequence id {s!r}")
            row[k] = s
            self.max_seq_id = max(self.max_seq_id, s)
        self.seq_ids_used.update(ids)
        if len(ids) > 1:
            self.multi_seq_tokens += 1
        b.logits[i] = 1 if logits else 0
        if logits:
            self.outputs.append(i)
        self.max_token = max(self.max_token, token)
        b.n_tokens = i + 1
        return i

    def add_sequence(
        self, tokens: Iterable[int], pos0: int, seq_ids: int | Sequence[int], *, logits_last: bool = False
    ) -> list[int]:
        """Append ``tokens`` at positions ``pos0, pos0+1, ...``; returns their batch indices."""
        toks = list(tokens)
        if self.n_tokens + len(toks) > self.capacity:
            raise LlamaError(f"{len(toks)} tokens do not fit in the batch ({self.capacity - self.n_tokens} free)")
        last = len(toks) - 1
        return [self.add(t, pos0 + k, seq_ids, logits_last and k == last) for k, t in enumerate(toks)]

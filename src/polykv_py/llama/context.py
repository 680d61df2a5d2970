"""A ``llama_context`` on a :class:`Model`: decode batches, read logits, own the KV memory,
save and load sequence states."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._ffi import ffi, lib
from ..errors import ContextFullError, LlamaError, SequenceError, StateError, TokenError
from ..prefix_file import read_prefix_file, write_prefix_file
from ._check import check_decode, check_nonzero, check_ptr
from ._owned import OwnedPointer
from .backend import max_parallel_sequences
from .batch import Batch
from .memory import Memory
from .params import ContextParams

if TYPE_CHECKING:
    from .model import Model

log = logging.getLogger(__name__)

_FLASH = {
    "auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


def _type_name(t: int) -> str:
    """ggml's name of a tensor type ("f16", "q8_0")."""
    return ffi.string(lib.ggml_type_name(t)).decode()


class Context(OwnedPointer):
    """Owns a ``llama_context``. Use as a context manager or call :meth:`close`.

    ``memory`` is the KV view (:class:`Memory`); ``tokens_decoded`` counts tokens that
    went through successful ``llama_decode`` calls.
    """

    _what = "context"

    def __init__(self, model: Model, params: ContextParams | None = None, **overrides: Any) -> None:
        self._ptr: Any = ffi.NULL
        p = replace(params or ContextParams(), **overrides)
        p.validate(max_parallel_sequences())
        self.model = model
        self.params = p
        threads = p.n_threads or os.cpu_count() or 1
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max
        cp.n_threads, cp.n_threads_batch = threads, p.n_threads_batch or threads
        cp.kv_unified = p.kv_unified
        cp.flash_attn_type = _FLASH[p.flash_attn]
        cp.no_perf = p.no_perf
        ptr = lib.llama_init_from_model(model.ptr, cp)
        self._ptr = check_ptr(ptr, f"creating a context ({asdict(p)})")
        self.n_ctx = int(lib.llama_n_ctx(ptr))
        self.n_ctx_seq = int(lib.llama_n_ctx_seq(ptr))
        self.n_batch = int(lib.llama_n_batch(ptr))
        self.n_ubatch = int(lib.llama_n_ubatch(ptr))
        self.n_seq_max = int(lib.llama_n_seq_max(ptr))
        self.kv_unified = bool(p.kv_unified)
        self._kv_types = (_type_name(cp.type_k), _type_name(cp.type_v))
        self.n_vocab = model.vocab.n_tokens
        self.tokens_decoded = 0
        self.memory = Memory(self)
        self._outputs: frozenset[int] = frozenset()
        model.track_context(self)

    # -- ownership ------------------------------------------------------------------
    def _free(self, ptr: Any) -> None:
        lib.llama_free(ptr)

    @property
    def n_stream(self) -> int:
        """KV streams: 1 with unified KV, else one per sequence."""
        return 1 if self.kv_unified else self.n_seq_max

    @property
    def kv_layout(self) -> dict[str, Any]:
        """What a saved sequence state needs to load here: KV streams and the K and V types
        (the ``kv`` of a prefix file; the patched server reports its own in ``/props``)."""
        return {"n_stream": self.n_stream, "type_k": self._kv_types[0], "type_v": self._kv_types[1]}

    # -- decoding -------------------------------------------------------------------
    def decode(self, batch: Batch) -> None:
        """Run ``llama_decode`` on ``batch``, after checking what libllama would assert on."""
        n = batch.n_tokens
        if n == 0:
            raise LlamaError("cannot decode an empty batch")
        if n > self.n_batch:
            raise LlamaError(f"a batch of {n} tokens exceeds this context's n_batch={self.n_batch}")
        if batch.max_seq_id >= self.n_seq_max:
            raise SequenceError(
                f"the batch uses sequence id {batch.max_seq_id}, but this context has n_seq_max={self.n_seq_max}"
            )
        if batch.max_token >= self.n_vocab:
            raise TokenError(f"the batch holds token id {batch.max_token}, outside the vocabulary [0, {self.n_vocab})")
        if not self.kv_unified and batch.multi_seq_tokens and self.n_seq_max > 1:
            raise SequenceError(
                "without unified KV a token cannot belong to several sequences; decode it into one and seq_cp it"
            )
        self._outputs = frozenset()
        rc = int(lib.llama_decode(self.ptr, batch.struct))
        check_decode(rc, n)
        self.memory.on_decode()
        self._outputs = frozenset(batch.outputs)
        self.tokens_decoded += n

    def decode_tokens(
        self, tokens: Sequence[int], *, seq_id: int = 0, pos0: int | None = None, logits_last: bool = True
    ) -> int | None:
        """Decode ``tokens`` into ``seq_id`` (in chunks of ``n_batch``), continuing after its last position.

        Returns the batch index of the last token's logits (None if ``logits_last`` is false).
        """
        toks = self.model.vocab.check_tokens(tokens)
        if not toks:
            raise TokenError("no tokens to decode")
        self.memory.check_seq(seq_id)
        start = self.memory.seq_pos_max(seq_id) + 1 if pos0 is None else pos0
        if start + len(toks) > self.n_ctx_seq:
            raise ContextFullError(
                f"sequence {seq_id} would reach position {start + len(toks) - 1}, "
                f"beyond the {self.n_ctx_seq} positions a sequence can hold"
            )
        idx = None
        with Batch(min(len(toks), self.n_batch)) as batch:
            for off in range(0, len(toks), self.n_batch):
                chunk = toks[off : off + self.n_batch]
                batch.clear()
                last = off + len(chunk) == len(toks)
                ids = batch.add_sequence(chunk, start + off, seq_id, logits_last=logits_last and last)
                self.decode(batch)
                if logits_last and last:
                    idx = ids[-1]
        return idx

    def check_output(self, idx: int) -> int:
        """Return ``idx`` if the last decode produced logits for batch index ``idx``."""
        if idx not in self._outputs:
            raise LlamaError(f"batch index {idx} has no logits from the last decode (outputs: {sorted(self._outputs)})")
        return idx

    def logits(self, idx: int) -> list[float]:
        """The logits of output ``idx`` of the last decode (``n_vocab`` floats)."""
        self.check_output(idx)
        p = check_ptr(lib.llama_get_logits_ith(self.ptr, idx), f"llama_get_logits_ith({idx})")
        return list(ffi.unpack(p, self.n_vocab))

    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        if n_threads < 1 or (n_threads_batch is not None and n_threads_batch < 1):
            raise ValueError("thread counts must be >= 1")
        lib.llama_set_n_threads(self.ptr, n_threads, n_threads_batch or n_threads)

    def perf(self) -> dict[str, float]:
        """libllama's own timings (ms) and token counts since the last :meth:`reset_perf`."""
        d = lib.llama_perf_context(self.ptr)
        return {"t_p_eval_ms": d.t_p_eval_ms, "t_eval_ms": d.t_eval_ms, "n_p_eval": d.n_p_eval, "n_eval": d.n_eval}

    def reset_perf(self) -> None:
        lib.llama_perf_context_reset(self.ptr)

    # -- sequence state -------------------------------------------------------------
    # The raw llama_state_seq_* calls trust the caller (see polykv_py.prefix_file for the verified prefix file).
    def _check_settled(self, seq_id: int) -> None:
        self.memory.check_seq(seq_id)
        if seq_id in self.memory.pending_copies:
            raise StateError(f"sequence {seq_id} has a pending cross-stream copy; decode once before saving it")

    def seq_state_bytes(self, seq_id: int) -> bytes:
        """The state of one sequence as bytes (``llama_state_seq_get_data``)."""
        self._check_settled(seq_id)
        size = int(lib.llama_state_seq_get_size(self.ptr, seq_id))
        check_nonzero(size, f"llama_state_seq_get_size(seq {seq_id})", StateError)
        buf = ffi.new("uint8_t[]", size)
        n = int(lib.llama_state_seq_get_data(self.ptr, buf, size, seq_id))
        check_nonzero(n, f"llama_state_seq_get_data(seq {seq_id})", StateError)
        return ffi.buffer(buf, n)[:]

    def set_seq_state_bytes(self, data: bytes, seq_id: int) -> int:
        """Load bytes from :meth:`seq_state_bytes` into ``seq_id`` (its old cells are removed first)."""
        self.memory.check_seq(seq_id)
        if not data:
            raise StateError("empty sequence state")
        self.memory.seq_rm(seq_id)
        n = int(lib.llama_state_seq_set_data(self.ptr, data, len(data), seq_id))
        what = (
            f"llama_state_seq_set_data(seq {seq_id}) (not a state, another KV stream layout or tensor shape, "
            "or not enough free KV cells)"
        )
        self.memory.mark_inexact(seq_id, 0)  # bytes of unknown origin (load_prefix verifies its own)
        return check_nonzero(n, what, StateError)

    def save_seq_file(self, path: str | os.PathLike[str], seq_id: int, tokens: Sequence[int]) -> int:
        """``llama_state_seq_save_file``: the sequence's state plus its token list; returns bytes written."""
        self._check_settled(seq_id)
        toks = self.model.vocab.check_tokens(tokens)
        arr = ffi.new("llama_token[]", toks) if toks else ffi.NULL
        n = int(lib.llama_state_seq_save_file(self.ptr, os.fsencode(path), seq_id, arr, len(toks)))
        return check_nonzero(n, f"llama_state_seq_save_file({path})", StateError)

    def load_seq_file(self, path: str | os.PathLike[str], seq_id: int) -> list[int]:
        """``llama_state_seq_load_file`` into ``seq_id``; returns the token list stored with it."""
        self.memory.check_seq(seq_id)
        p = os.fsencode(path)
        if not os.path.isfile(path):
            raise StateError(f"no such state file: {os.fsdecode(p)}")
        count = ffi.new("size_t *")
        lib.llama_state_seq_load_file(self.ptr, p, seq_id, ffi.NULL, 0, count)  # token count only
        cap = max(1, int(count[0]))
        toks = ffi.new("llama_token[]", cap)
        self.memory.seq_rm(seq_id)
        n = int(lib.llama_state_seq_load_file(self.ptr, p, seq_id, toks, cap, count))
        self.memory.mark_inexact(seq_id, 0)  # nobody recorded what computed a state file's cells
        check_nonzero(n, f"llama_state_seq_load_file({os.fsdecode(p)})", StateError)
        return list(ffi.unpack(toks, int(count[0])))

    def save_prefix(self, path: str | os.PathLike[str], seq_id: int, tokens: Sequence[int]) -> Path:
        """Save ``seq_id``, which must hold exactly ``tokens`` at positions 0..n-1, as a verified prefix file.

        Its cells must be exact (:meth:`Memory.exact_len`): a restore trusts them as computed from the tokens."""
        toks = self.model.vocab.check_tokens(tokens)
        if not toks:
            raise StateError("cannot save an empty prefix")
        if self.memory.exact_len(seq_id) < len(toks):
            raise StateError(
                f"sequence {seq_id}'s cells from position {self.memory.exact_len(seq_id)} on were shifted, copied "
                "from another left context or loaded from raw state: not exact, not saved as a prefix"
            )
        lo, hi = self.memory.seq_pos_range(seq_id)
        if (lo, hi) != (0, len(toks) - 1):
            raise StateError(
                f"sequence {seq_id} holds positions [{lo}, {hi}], "
                f"not the {len(toks)} tokens given ([0, {len(toks) - 1}])"
            )
        state = self.seq_state_bytes(seq_id)
        return write_prefix_file(path, state, model=self.model.fingerprint(), tokens=toks, kv=self.kv_layout)

    def load_prefix(
        self, path: str | os.PathLike[str], seq_id: int, expected_tokens: Sequence[int] | None = None
    ) -> list[int]:
        """Load a prefix saved by :meth:`save_prefix` into ``seq_id``; returns its tokens.

        Refuses (``StateError``) a file from another model, another token list than
        ``expected_tokens``, another stream layout, a damaged state, or one that does not
        end up at positions 0..n-1 (e.g. not enough free cells).
        """
        self.memory.check_seq(seq_id)
        tokens, state = read_prefix_file(
            path,
            model=self.model.fingerprint(),
            kv=self.kv_layout,
            n_ctx_seq=self.n_ctx_seq,
            check_tokens=self.model.vocab.check_tokens,
            expected_tokens=expected_tokens,
        )
        self.set_seq_state_bytes(state, seq_id)
        lo, hi = self.memory.seq_pos_range(seq_id)
        if (lo, hi) != (0, len(tokens) - 1):
            self.memory.seq_rm(seq_id)
            raise StateError(f"{path}: loaded sequence holds positions [{lo}, {hi}], expected [0, {len(tokens) - 1}]")
        self.memory.mark_exact(seq_id)  # authenticated, and saved from exact cells only
        return tokens

    def __repr__(self) -> str:
        if self.closed:
            return "Context(closed)"
        return (
            f"Context(n_ctx={self.n_ctx}, n_seq_max={self.n_seq_max}, kv_unified={self.kv_unified}, "
            f"n_batch={self.n_batch}, n_ubatch={self.n_ubatch})"
        )

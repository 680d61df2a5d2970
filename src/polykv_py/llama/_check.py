"""The one place where libllama's return codes become polykv exceptions.

Every call into libllama whose result can signal failure goes through one of these
helpers, so the mapping from C results to the error hierarchy lives here only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ContextFullError, LlamaError, PolykvError, SequenceError, TokenError

#: llama_decode return codes (llama.h) and what they mean.
DECODE_OK = 0
DECODE_NO_KV_SLOT = 1
DECODE_ABORTED = 2
DECODE_INVALID_BATCH = -1

#: what libllama's size-returning calls answer when the size overflowed int32.
INT32_MIN = -(2**31)


def check_decode(rc: int, n_tokens: int) -> None:
    """Turn a ``llama_decode`` return code into an exception (0 is success)."""
    if rc == DECODE_OK:
        return
    if rc == DECODE_NO_KV_SLOT:
        raise ContextFullError(
            f"llama_decode: no KV slot for a batch of {n_tokens} tokens: the context is full "
            "(free sequences with seq_rm, or create the context with a larger n_ctx)"
        )
    if rc == DECODE_ABORTED:
        raise LlamaError("llama_decode was aborted; the ubatches already processed remain in memory")
    if rc == DECODE_INVALID_BATCH:
        raise LlamaError(f"llama_decode rejected the batch of {n_tokens} tokens as invalid (see the llama log)")
    if rc < 0:
        raise LlamaError(f"llama_decode failed with fatal error {rc}; processed ubatches remain in memory")
    raise LlamaError(f"llama_decode returned the unknown warning code {rc}")


def check_ptr(ptr: Any, what: str, exc: type[PolykvError] = LlamaError) -> Any:
    """Return ``ptr`` if it is not NULL, else raise ``exc`` naming ``what`` failed."""
    # a cffi NULL pointer compares equal to ffi.NULL and is falsy when cast to bool via ==
    if ptr is None or ptr == _null():
        raise exc(f"{what} failed (libllama returned NULL; see the llama log)")
    return ptr


def check_true(ok: bool, what: str, exc: type[PolykvError] = LlamaError) -> None:
    """Raise ``exc`` if a boolean libllama result is false."""
    if not ok:
        raise exc(f"{what} returned false")


def check_nonzero(n: int, what: str, exc: type[PolykvError] = LlamaError, *, at_most: int | None = None) -> int:
    """Return ``n`` if it is positive (and at most ``at_most``), else raise ``exc``.

    libllama's state calls return the number of bytes they handled, 0 on failure.
    """
    if n <= 0 or (at_most is not None and n > at_most):
        raise exc(f"{what} failed (returned {n}; see the llama log)")
    return n


def check_seq_rm(ok: bool, seq_id: int, p0: int, p1: int) -> None:
    """``llama_memory_seq_rm`` returns false when a partial sequence cannot be removed."""
    if not ok:
        raise SequenceError(f"seq_rm(seq_id={seq_id}, p0={p0}, p1={p1}) was refused by the memory module")


def check_template(n: int) -> int:
    """``llama_chat_apply_template`` returns a negative length for a template it does not know."""
    if n < 0:
        raise LlamaError("llama_chat_apply_template does not support this chat template")
    return n


def read_sized(fill: Callable[[Any, int], int], cap: int, what: str, *, ctype: str = "char[]") -> Any:
    """Call ``fill(buf, cap)`` on a new ``ctype`` array of ``cap`` items; return the items it wrote.

    libllama's convention (tokenize, detokenize, token to piece): the result is the number of
    items written, or minus the number needed when ``cap`` was too small; then the call is
    made once more with that capacity. ``char[]`` gives bytes, ``llama_token[]`` a list.
    """
    from .._ffi import ffi

    for _ in range(2):
        buf = ffi.new(ctype, cap)
        n = int(fill(buf, cap))
        if n >= 0:
            return ffi.unpack(buf, n)
        if n == INT32_MIN:
            raise TokenError(f"{what} overflowed int32")
        cap = -n
    raise LlamaError(f"{what} kept asking for a larger buffer")


def _null() -> Any:
    from .._ffi import ffi

    return ffi.NULL

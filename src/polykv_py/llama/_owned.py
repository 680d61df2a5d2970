"""Ownership of one C object: the pattern Model, Context and Sampler share."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self

from .._ffi import ffi
from ..errors import LlamaError


class OwnedPointer:
    """Owns one C pointer: ``ptr`` while open; ``close()`` frees it exactly once.

    Context manager; also freed on garbage collection. Subclasses set ``_what`` (for the
    "is closed" error) and implement ``_free``.
    """

    _ptr: Any = ffi.NULL
    _what = "object"

    def _free(self, ptr: Any) -> None:
        raise NotImplementedError

    @property
    def ptr(self) -> Any:
        """The C pointer; raises :class:`LlamaError` once closed."""
        if self._ptr == ffi.NULL:
            raise LlamaError(f"the {self._what} is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr == ffi.NULL

    def close(self) -> None:
        """Free the C object. Idempotent."""
        if self._ptr != ffi.NULL:
            self._free(self._ptr)
            self._ptr = ffi.NULL

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

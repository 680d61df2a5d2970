"""Ownership of one C object (the pattern Model, Context and Sampler share), and plain
read-only attributes that call a libllama getter on an object's pointer."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar, overload

from .._ffi import ffi
from ..errors import LlamaError

_T = TypeVar("_T")


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


class _HasPtr(Protocol):
    @property
    def ptr(self) -> Any: ...


class CGetter(Generic[_T]):
    """A read-only attribute whose value is ``convert(getter(obj.ptr))``.

    For the one-argument libllama getters: ``n_layer = CGetter(lib.llama_model_n_layer, int)``.
    Read on every access, so a closed owner raises like any other use.
    """

    def __init__(self, getter: Callable[[Any], Any], convert: Callable[[Any], _T], doc: str | None = None) -> None:
        self._getter = getter
        self._convert = convert
        self.__doc__ = doc

    @overload
    def __get__(self, obj: None, owner: type[Any] | None = None) -> Self: ...

    @overload
    def __get__(self, obj: _HasPtr, owner: type[Any] | None = None) -> _T: ...

    def __get__(self, obj: _HasPtr | None, owner: type[Any] | None = None) -> Self | _T:
        if obj is None:
            return self
        return self._convert(self._getter(obj.ptr))

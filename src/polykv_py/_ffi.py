"""The only module that imports the compiled extension ``polykv_py._llama_cffi``.

It refuses an extension built from another llama.cpp commit or patch series than the
installed native build (its build-info record), with a clear ImportError.

``ffi`` is typed by :class:`FFI`, the part of cffi's ``FFI`` object the bindings use.
``lib`` stays ``Any``: its functions are the declarations in ``src/_cffi_src/llama_cdef.h``,
and restating them here would be a second copy of that header.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from .native import build_info

_F = TypeVar("_F", bound=Callable[..., Any])


class FFI(Protocol):
    """What the bindings use of a compiled cffi module's ``ffi``."""

    NULL: Any

    def new(self, cdecl: str, init: Any = ..., /) -> Any: ...

    def cast(self, cdecl: str, value: Any, /) -> Any: ...

    def string(self, cdata: Any, maxlen: int = ..., /) -> bytes: ...

    def unpack(self, cdata: Any, length: int, /) -> Any: ...

    def buffer(self, cdata: Any, size: int = ..., /) -> Any: ...

    def def_extern(self, name: str = ..., onerror: Any = ..., /) -> Callable[[_F], _F]: ...


try:
    from ._llama_cffi import ffi as _ffi
    from ._llama_cffi import lib as _lib
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "polykv's native extension (polykv_py._llama_cffi) is missing: install polykv with "
        f"`pip install .` from its source tree ({exc})"
    ) from exc

ffi: FFI = _ffi
lib: Any = _lib


def _check_stamps() -> None:
    info = build_info()
    commit = ffi.string(lib.polykv_upstream_commit()).decode()
    series = ffi.string(lib.polykv_patch_series_sha256()).decode()
    if commit != info["upstream_commit"] or series != info["patch_series_sha256"]:
        raise ImportError(
            "polykv_py._llama_cffi does not match the installed native build: extension built for "
            f"llama.cpp {commit} with patch series {series[:12]}, but the installed build is "
            f"{info['upstream_commit']} with series {info['patch_series_sha256'][:12]}. "
            "Reinstall polykv (`pip install --force-reinstall .`)."
        )


_check_stamps()

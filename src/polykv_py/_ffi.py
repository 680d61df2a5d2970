"""The only module that imports the compiled extension ``polykv_py._llama_cffi``.

It refuses an extension built from another llama.cpp commit or patch series than the
installed native build (its build-info record), with a clear ImportError.
"""

from __future__ import annotations

from .native import build_info

try:
    from ._llama_cffi import ffi, lib  # type: ignore[import-not-found]
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "polykv's native extension (polykv_py._llama_cffi) is missing: install polykv with "
        f"`pip install .` from its source tree ({exc})"
    ) from exc


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

__all__ = ["ffi", "lib"]

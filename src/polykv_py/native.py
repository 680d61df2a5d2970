"""Paths to the native artifacts installed with the wheel, and the build-info record.

The wheel carries, under ``polykv_py/_native/``: ``bin/llama-server`` (patched),
``bin/llama-server-upstream`` (pristine server sources, same libraries),
``lib/`` (libllama, ggml, ...) and ``build_info.json``.  Environment variables
override the binaries, for development against a hand-built tree.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from .errors import BuildError

NATIVE_DIR = Path(__file__).resolve().parent / "_native"

ServerKind = Literal["patched", "upstream"]

_BINARIES: dict[str, tuple[str, str]] = {
    "patched": ("llama-server", "POLYKV_SERVER_BIN"),
    "upstream": ("llama-server-upstream", "POLYKV_UPSTREAM_SERVER_BIN"),
}


def server_binary(kind: ServerKind = "patched") -> Path:
    """Path of the patched (``"patched"``) or reference (``"upstream"``) llama-server."""
    try:
        name, env = _BINARIES[kind]
    except KeyError:
        raise ValueError(f"server kind must be one of {sorted(_BINARIES)}, not {kind!r}") from None
    override = os.environ.get(env)
    path = Path(override) if override else NATIVE_DIR / "bin" / name
    if not path.is_file() or not os.access(path, os.X_OK):
        raise BuildError(
            f"{name} not found at {path}"
            + (f" (from ${env})" if override else "; was polykv installed with `pip install .`?")
        )
    return path


def lib_dir() -> Path:
    """Directory holding libllama and the ggml libraries."""
    return NATIVE_DIR / "lib"


@lru_cache(maxsize=1)
def build_info() -> dict[str, Any]:
    """The build-info record written by the native build.

    Keys: ``upstream_commit``, ``llama_cpp_source``, ``patch_series_sha256``,
    ``patches``, ``backends``, ``cpu_flags``, ``cmake_defines``, ``build_type``.
    """
    path = NATIVE_DIR / "build_info.json"
    if not path.is_file():
        raise BuildError(f"build info not found at {path}; was polykv installed with `pip install .`?")
    return json.loads(path.read_text())

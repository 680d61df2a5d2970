"""Paths to the native artifacts installed with the wheel, and the build-info record.

The wheel carries, under ``polykv_py/_native/``: ``bin/llama-server`` (patched),
``bin/llama-server-upstream`` (pristine server sources, same libraries),
``lib/`` (libllama, ggml, ...) and ``build_info.json``.  Environment variables
override the binaries, for development against a hand-built tree.
"""

from __future__ import annotations

import json
import os
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import BuildError

NATIVE_DIR = Path(__file__).resolve().parent / "_native"


class ServerKind(StrEnum):
    """Which llama-server: polykv's patched build, or the reference built from the pristine sources."""

    PATCHED = "patched"
    UPSTREAM = "upstream"

    @classmethod
    def of(cls, kind: ServerKind | str) -> ServerKind:
        """``kind`` as a member (a plain string is accepted); a clear ValueError for anything else."""
        try:
            return cls(kind)
        except ValueError:
            raise ValueError(f"server kind must be one of {[k.value for k in cls]}, not {kind!r}") from None


_BINARIES: dict[ServerKind, tuple[str, str]] = {
    ServerKind.PATCHED: ("llama-server", "POLYKV_SERVER_BIN"),
    ServerKind.UPSTREAM: ("llama-server-upstream", "POLYKV_UPSTREAM_SERVER_BIN"),
}


def server_binary(kind: ServerKind | str = ServerKind.PATCHED) -> Path:
    """Path of the patched or the reference (``upstream``) llama-server."""
    name, env = _BINARIES[ServerKind.of(kind)]
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

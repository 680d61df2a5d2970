"""Where polykv keeps downloaded inputs (pinned sdist, default model)."""

from __future__ import annotations

import os
from pathlib import Path

#: Environment variable that overrides the cache directory.
CACHE_ENV = "POLYKV_CACHE_DIR"


def cache_dir() -> Path:
    """Return the polykv cache directory, creating it if needed.

    ``$POLYKV_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/polykv``, else ``~/.cache/polykv``.
    """
    env = os.environ.get(CACHE_ENV)
    if env:
        path = Path(env).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(base) / "polykv"
    path.mkdir(parents=True, exist_ok=True)
    return path

"""Fixtures shared by the unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def fake_model(tmp_path: Path) -> Path:
    """A file that passes for a GGUF by its magic bytes (the launcher never loads it)."""
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 16)
    return path

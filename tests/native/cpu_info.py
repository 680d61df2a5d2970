"""What the CPU running the tests has, for the kernel checks that depend on it."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    info = Path("/proc/cpuinfo")
    return set(info.read_text().split()) if info.exists() else set()

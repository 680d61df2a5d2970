"""The machine a benchmark ran on, as its reports record it."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def load_avg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 0.01."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    """CPU model, logical CPUs and the load average now (``load_avg_start``)."""
    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "load_avg_start": load_avg()}

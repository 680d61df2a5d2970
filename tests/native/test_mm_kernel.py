"""The Q4_1 register tiles (patch 0079) at the ggml level: upstream's results, bit for bit.

``polykv-mm-check`` (built from native/check/mm_check.cpp with the wheel) computes mul_mat nodes of Q4_1
weights times F32 activations with ggml's CPU backend (1 and 2 threads; 1-192 rows and 1-33 columns, so
blocks of 16 x 16 and every remainder of rows and columns; rows of 32-1,536 values, and the default model's
1,536 x 576 at 16 agents) and compares every output with ``ggml_vec_dot_q4_1_q8_1`` on the same quantized
activations. The tiles are compiled where the build targets AVX-512 VNNI; elsewhere upstream's loop runs and
the check still compares.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
from cpu_info import cpu_flags

from polykv_py.native import NATIVE_DIR

EXE = NATIVE_DIR / "bin" / "polykv-mm-check"
#: the instruction sets the tiles are compiled for (polykv-mm.cpp); the build targets what the CPU has
TILE_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


def run_check(**env: str) -> dict[str, Any]:
    assert EXE.is_file(), f"{EXE} missing: was polykv installed with `pip install .`?"
    proc = subprocess.run(
        [str(EXE)], capture_output=True, text=True, timeout=600, check=False, env={**os.environ, **env}
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-2000:] + proc.stdout[-2000:]
    out: dict[str, Any] = json.loads(lines[-1])
    out["returncode"] = proc.returncode
    out["stderr"] = proc.stderr[-2000:]
    return out


def test_tiles_give_upstreams_results_bit_for_bit() -> None:
    out = run_check()
    assert out["differing_outputs"] == 0, out
    assert out["returncode"] == 0, out
    assert out["cases"] == 2 * 4 * 8 * 11 + 1 and out["outputs"] > 100_000, out
    if cpu_flags() >= TILE_FLAGS:
        # the tiles computed the nodes (every one with 2+ columns per thread): not upstream's loop against itself
        assert out["enabled"] is True, out
        assert out["tile_blocks"] >= out["cases"] // 2 and out["untiled_cases"] == 0, out


def test_switched_off_the_tiles_compute_nothing() -> None:
    out = run_check(POLYKV_MM_TILES="0")
    assert out["enabled"] is False and out["tile_blocks"] == 0, out
    assert out["differing_outputs"] == 0 and out["returncode"] == 0, out


@pytest.mark.parametrize("args", [["--bench", "16"], ["--bench", "16", "33", "16", "1", "1"], ["extra"]])
def test_bad_arguments_get_usage(args: list[str]) -> None:
    proc = subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 64 and "usage:" in proc.stderr

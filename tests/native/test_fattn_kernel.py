"""The shared-prefix decode attention kernel (patch 0076) at the ggml level.

``polykv-fattn-check`` (built from native/check/fattn_check.cpp with the wheel) computes
flash-attention nodes shaped like llama.cpp's decode graph on random Q/K/V and masks (a shared
prefix with interleaved private cells, whole tiles nobody sees, random masks, the server's decode layout with
each agent's own suffix and agents finishing one by one), with GQA ratios
1/3/8, head sizes 64/128, f16 and q8_0 KV and 1-3 threads, once with the path off (upstream's
kernel) and once on, against a double-precision reference; on x86-64 also the same computation
compiled for AVX2 and without SIMD; also prompt batches of 64-511 rows (several agents' turns, one
sequence's causal prompt), and attention sinks (gpt-oss: one logit per query head in every softmax,
above the row's scores on some heads). Nodes the path must leave to upstream (softcap, ALiBi,
other KV types, 1 or 512+ rows) are computed with the switch on and must come out bit for bit as
upstream's. The kernel source must also compile where ggml's vectors are sizeless (ARM SVE,
RISC-V RVV): checked with the cross compilers when they are installed.
"""

from __future__ import annotations

import json
import logging
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cpu_info import cpu_flags

from polykv_py.native import NATIVE_DIR

log = logging.getLogger(__name__)

#: From this many query rows upstream computes a node with its tiled kernel (f32, like the path's).
UPSTREAM_TILED_ROWS = 64
#: Error of an f32 computation of these nodes against the double reference (both kernels measure 1e-6 - 5e-6).
F32_ROUNDING = 1e-5
#: Max abs error allowed against the double reference (outputs are averages of N(0,1) values).
#: Measured here: at most 4e-6 for every build of the path; upstream's kernel 5e-3-3e-2 (it rounds
#: Q to f16 (q8_0 for q8_0 K) and accumulates V in f16).
MAX_ERR = 1e-4


@pytest.fixture(scope="module")
def all_cases() -> list[dict[str, Any]]:
    exe = NATIVE_DIR / "bin" / "polykv-fattn-check"
    assert exe.is_file(), f"{exe} missing: was polykv installed with `pip install .`?"
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(out) >= 36
    return out


@pytest.fixture(scope="module")
def taken(all_cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cases the path must compute."""
    out = [c for c in all_cases if not c["decline"]]
    assert len(out) >= 36
    log.warning(
        "polykv-fattn-check: %d cases; max abs error vs double: path %.2g (avx2 %.2g, scalar %.2g), upstream %.2g",
        len(out),
        max(c["err_on"] for c in out),
        max(c["err_avx2"] for c in out),  # -1: not run (no AVX2 on this CPU)
        max(c["err_scalar"] for c in out),
        max(c["err_off"] for c in out),
    )
    return out


@pytest.fixture
def cases(taken: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return taken


def test_every_case_took_the_path_and_is_within_bounds(cases: list[dict[str, Any]]) -> None:
    for c in cases:
        assert c["ops"] == 1, c  # on: this path computed the node; off: upstream's (its rounding differs)
        assert c["on_vs_off"] > 0, c
        assert c["err_on"] <= MAX_ERR, c
        if c["N"] < UPSTREAM_TILED_ROWS:
            assert c["err_on"] <= c["err_off"], c  # never less exact than upstream's one-row kernel (f16 Q)
        else:  # upstream's tiled kernel computes in f32 too: the same up to f32 rounding
            assert c["err_on"] <= max(c["err_off"], F32_ROUNDING), c


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX2 and scalar builds are x86-64 only")
def test_avx2_and_scalar_builds_agree(cases: list[dict[str, Any]]) -> None:
    avx2 = {"avx2", "fma", "f16c"} <= cpu_flags()
    for c in cases:
        assert 0 <= c["err_scalar"] <= MAX_ERR, c
        if avx2:  # the AVX2 build runs only on a CPU that has it
            assert 0 <= c["err_avx2"] <= MAX_ERR, c


def test_shared_private_and_masked_tiles_are_all_exercised(cases: list[dict[str, Any]]) -> None:
    by = {layout: [c for c in cases if c["layout"] == layout] for layout in ("prefix", "holes", "random", "agents")}
    assert all(c["tiles_skipped"] > 0 for c in by["holes"] + by["agents"])  # whole tiles nobody sees are skipped
    # the server's decode layout: private tiles (spans of several on AVX-512 with f16 KV) around skipped ones
    assert len(by["agents"]) >= 4 and all(c["tiles_private"] > 0 for c in by["agents"])
    assert all(c["tiles_shared"] > 0 for c in cases)
    # private cells interleaved one per agent: private tiles (scored as (row, cell) pairs) from 16 agents on
    assert all(c["tiles_private"] > 0 for c in by["prefix"] + by["holes"] if c["N"] >= 16)
    # prompt batches of 64-511 rows (agents' turns over their transcripts, one sequence's causal prompt)
    assert {c["layout"] for c in cases if c["N"] >= UPSTREAM_TILED_ROWS} == {"prefix", "holes", "causal"}
    # 4: the gpt-oss-shaped sink cases; 71: multi-query, more query heads per KV head than one group of 4 rows
    assert {c["n_head"] // c["n_head_kv"] for c in cases} == {1, 3, 4, 8, 71}
    assert {c["DK"] for c in cases} == {64, 128}
    assert {c["kv_type"] for c in cases} == {"f16", "q8_0"}
    # sinks in decode and prompt batches, over f16 and q8_0 KV
    with_sinks = [c for c in cases if c["sinks"]]
    assert {c["layout"] for c in with_sinks} == {"prefix", "holes", "random", "causal", "agents"}
    assert {c["kv_type"] for c in with_sinks} == {"f16", "q8_0"}


def test_unsupported_nodes_are_declined_and_left_to_upstream(all_cases: list[dict[str, Any]]) -> None:
    declined = [c for c in all_cases if c["decline"]]
    assert {c["decline"] for c in declined} == {"softcap", "alibi", "kv_type", "rows"}
    assert {c["kv_type"] for c in declined if c["decline"] == "kv_type"} >= {"q4_0", "q5_1"}
    assert {c["N"] for c in declined if c["decline"] == "rows"} == {1, 512}
    for c in declined:
        assert c["ops"] == 0, c  # the switch was on, and the path did not take the node
        assert c["on_vs_off"] == 0, c  # upstream's kernel computed it, bit for bit
        assert c["err_scalar"] == -1 and c["err_avx2"] == -1, c  # every build declines it


CROSS = {
    "arm64-sve": ["aarch64-linux-gnu-g++", "-march=armv8.2-a+sve+fp16"],
    "arm64-neon": ["aarch64-linux-gnu-g++", "-march=armv8.2-a+fp16"],
    "riscv64-rvv": ["riscv64-linux-gnu-g++", "-march=rv64gcv", "-mabi=lp64d"],
}


@pytest.mark.parametrize("target", sorted(CROSS))
def test_kernel_compiles_for_sizeless_vector_targets(target: str, tmp_path: Path) -> None:
    """Arrays of GGML_F32_VEC do not compile where it is a sizeless type (SVE): those targets get the scalar code."""
    import patchtool  # scripts/, on sys.path through pytest's pythonpath option

    cmd = CROSS[target]
    if shutil.which(cmd[0]) is None:
        pytest.skip(f"{cmd[0]} not installed (Debian: g++-aarch64-linux-gnu, g++-riscv64-linux-gnu)")
    ggml = patchtool.ROOT / "vendor" / "llama.cpp" / "ggml"
    if not (ggml / "src" / "ggml-cpu" / "simd-mappings.h").is_file():
        pytest.skip("vendor/llama.cpp is not unpacked (pip install . unpacks it)")
    src = patchtool.NATIVE_DIR / "ggml-cpu" / "polykv-fattn.cpp"
    includes = [f"-I{ggml / 'src'}", f"-I{ggml / 'src' / 'ggml-cpu'}", f"-I{ggml / 'include'}", f"-I{src.parent}"]
    proc = subprocess.run(
        [*cmd, "-std=c++17", "-O2", "-c", str(src), *includes, "-o", str(tmp_path / "fa.o")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_bench_reports_the_attention_arithmetic_and_the_fma_peak() -> None:
    """``--bench`` (numbers docs/shared-decode.md cites) counts the flops from the mask and measures the FMA peak."""
    exe = NATIVE_DIR / "bin" / "polykv-fattn-check"
    n, n_kv, n_priv = 16, 1024, 256
    proc = subprocess.run(
        [str(exe), "--bench", str(n), str(n_kv), "1", str(n_priv)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    log.warning("polykv-fattn-check --bench %d %d 1 %d: %s", n, n_kv, n_priv, r)
    # every token sees the prefix, each private cell one token; 9 query heads, a 64-wide dot and axpy per pair
    visible = n * (n_kv - n_priv) + n_priv
    assert r["gflop"] == pytest.approx(visible * 9 * 2 * (64 + 64) / 1e9, abs=1e-6)
    assert r["ms_off"] > 0 and r["ms_on"] > 0 and r["err_on"] <= MAX_ERR
    assert r["gflops_on"] == pytest.approx(r["gflop"] / r["ms_on"] * 1e3, rel=1e-2)
    flags = cpu_flags()
    if platform.machine() == "x86_64" and ("avx512f" in flags or {"avx2", "fma"} <= flags):
        assert r["fma_peak_gflops"] > 0
        assert r["on_of_peak"] == pytest.approx(r["gflops_on"] / r["fma_peak_gflops"], rel=1e-2)
    else:
        assert r["fma_peak_gflops"] == -1 and r["on_of_peak"] == -1


def test_bench_cold_reads_the_caches_away_and_computes_the_same_node() -> None:
    """``--bench ... cold`` (bench.decode's cold nodes) reads 64 MiB per thread before each computation, untimed:
    the same node, the same arithmetic and the same error as warm; only the clock may differ."""
    exe = NATIVE_DIR / "bin" / "polykv-fattn-check"
    out = {}
    for mode in ("warm", "cold"):
        proc = subprocess.run([str(exe), "--bench", "16", "1024", "2", "256", "prefix", mode],
                              capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    log.warning("polykv-fattn-check --bench 16 1024 2 256: warm %s, cold %s", out["warm"], out["cold"])
    warm, cold = out["warm"], out["cold"]
    assert cold["gflop"] == warm["gflop"] and cold["err_on"] == warm["err_on"] <= MAX_ERR
    assert cold["ms_on"] > 0 and cold["ms_off"] > 0


def test_a_switch_flipped_during_computes_never_splits_a_node() -> None:
    """``--toggle``: another thread flips the switch while one node is computed 400 times on 2 threads. The switch
    is read once per graph compute (issue 34), so every result is the path's or upstream's, bit for bit; both must
    occur (the flips really raced the computes)."""
    exe = NATIVE_DIR / "bin" / "polykv-fattn-check"
    proc = subprocess.run([str(exe), "--toggle", "400"], capture_output=True, text=True, timeout=300, check=False)
    r = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    log.warning("polykv-fattn-check --toggle 400: %s", r)
    assert proc.returncode == 0 and r.get("mixed") == 0, (r, proc.stderr[-2000:])
    assert r["on"] > 0 and r["off"] > 0 and r["on"] + r["off"] == 400

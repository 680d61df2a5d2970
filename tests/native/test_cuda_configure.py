"""`pip install . -C cmake.define.GGML_CUDA=ON`: CMake configures the CUDA backend (configure only).

Where nvcc is on PATH, this runs our CMakeLists.txt with -DGGML_CUDA=ON as
scikit-build-core would (the define passed through unchanged), in a temporary build folder
with a private llama.cpp tree unpacked from the cached pinned sdist (vendor/ is not touched),
and checks what CMake generated: the CUDA compiler, the ggml-cuda shared library with its .cu
sources, cuBLAS linked, the library installed into the wheel and built by `pip install`,
and CUDA in build_info.json. Nothing is compiled.

A toolkit without cuBLAS (one put together from NVIDIA's pip wheels) gets it from
scripts/cuda_deps.py: the pinned nvidia-cublas wheel, fetched by name into the polykv cache on
first use (about 450 MB, a few seconds here), extracted, then deleted. With no libcuda on the
machine (no NVIDIA driver, no toolkit stubs) the configure adds GGML_CUDA_NO_VMM=ON, as
docs/build.md tells users to: ggml-cuda then does not link the driver library.

The cuda_deps extraction tests at the bottom need neither nvcc nor the network.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import cuda_deps  # scripts/, on sys.path through pytest's pythonpath option (pyproject.toml)
import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCH = "90"


NVCC = shutil.which("nvcc")
CMAKE = shutil.which("cmake")
NINJA = shutil.which("ninja")


def _cmake_version() -> tuple[int, ...] | None:
    if CMAKE is None:
        return None
    out = subprocess.run([CMAKE, "--version"], check=False, capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"cmake version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


CMAKE_VERSION = _cmake_version()

_NEEDS = [
    pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: no CUDA toolkit to configure against"),
    pytest.mark.skipif(
        CMAKE_VERSION is None or CMAKE_VERSION < (3, 21),
        reason=f"cmake >= 3.21 is not on PATH (found: {CMAKE or 'no cmake'}, version {CMAKE_VERSION})",
    ),
]


def needs_cuda_configure(test):
    """Skip (with the reason) where there is no nvcc or no usable cmake."""
    for mark in _NEEDS:
        test = mark(test)
    return test


@dataclass
class Configure:
    cmd: list[str]
    returncode: int
    output: str
    build: Path
    seconds: float
    cuda_version: str  # nvcc's, as cuda_deps read it
    defines: dict[str, str]
    no_vmm: bool
    cache: dict[str, str] = field(default_factory=dict)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-n:])


@pytest.fixture(scope="module")
def cuda_configure(tmp_path_factory: pytest.TempPathFactory) -> Configure:
    assert NVCC and CMAKE
    tmp = tmp_path_factory.mktemp("cuda-configure")
    try:
        toolkit = cuda_deps.find_toolkit(NVCC)
        defines = cuda_deps.cmake_defines(nvcc=NVCC)
    except cuda_deps.CudaDepsError as exc:
        pytest.fail(f"cannot supply cuBLAS for the CUDA configure: {exc}", pytrace=False)
    no_vmm = cuda_deps.find_cuda_driver(toolkit) is None
    build = tmp / "build"
    # CMake's file API: the generated targets, their sources, includes, links and installs
    query = build / ".cmake" / "api" / "v1" / "query"
    query.mkdir(parents=True)
    (query / "codemodel-v2").touch()
    cmd = [
        CMAKE,
        "-S",
        str(ROOT),
        "-B",
        str(build),
        "-G",
        "Ninja" if NINJA else "Unix Makefiles",
        f"-DPython_EXECUTABLE={sys.executable}",
        # a private tree from the cached pinned sdist: vendor/ is neither read nor patched
        f"-DPOLYKV_VENDOR_DIR={tmp / 'llama.cpp'}",
        f"-DPOLYKV_UPSTREAM_SERVER_DIR={tmp / 'upstream-server'}",
        "-DGGML_CUDA=ON",
        f"-DCMAKE_CUDA_ARCHITECTURES={ARCH}",
        *(f"-D{k}={v}" for k, v in defines.items()),
    ]
    if no_vmm:
        cmd.append("-DGGML_CUDA_NO_VMM=ON")
    env = {k: v for k, v in os.environ.items() if k != "POLYKV_LLAMA_CPP_DIR"}
    start = time.monotonic()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=600)
    seconds = time.monotonic() - start
    logging.getLogger(__name__).info("CUDA configure: %.1f s, rc %d: %s", seconds, proc.returncode, " ".join(cmd))
    result = Configure(
        cmd, proc.returncode, proc.stdout + proc.stderr, build, seconds, toolkit.version, defines, no_vmm
    )
    cache_file = build / "CMakeCache.txt"
    if cache_file.is_file():
        for line in cache_file.read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9_.+-]+):[A-Z]+=(.*)$", line)
            if m:
                result.cache[m.group(1)] = m.group(2)
    return result


@pytest.fixture(scope="module")
def configured(cuda_configure: Configure) -> Configure:
    if cuda_configure.returncode != 0:
        pytest.fail(f"CUDA configure failed (rc {cuda_configure.returncode}):\n{cuda_configure.tail()}", pytrace=False)
    return cuda_configure


def _codemodel(build: Path) -> tuple[dict[str, dict], dict[str, str]]:
    """target name -> target object, target id -> name, from the file API reply."""
    reply = build / ".cmake" / "api" / "v1" / "reply"
    index = json.loads(max(reply.glob("index-*.json")).read_text())
    cm_file = next(o["jsonFile"] for o in index["objects"] if o["kind"] == "codemodel")
    config = json.loads((reply / cm_file).read_text())["configurations"][0]
    targets = {t["name"]: json.loads((reply / t["jsonFile"]).read_text()) for t in config["targets"]}
    names = {t["id"]: t["name"] for t in config["targets"]}
    return targets, names


@needs_cuda_configure
def test_configure_with_cuda_succeeds(cuda_configure: Configure) -> None:
    assert cuda_configure.returncode == 0, f"CUDA configure failed:\n{cuda_configure.tail()}"
    assert "Generating done" in cuda_configure.output
    assert "Including CUDA backend" in cuda_configure.output


@needs_cuda_configure
def test_cache_has_cuda_on_and_the_cuda_compiler(configured: Configure) -> None:
    cache = configured.cache
    assert cache.get("GGML_CUDA") == "ON"
    assert cache.get("CMAKE_CUDA_ARCHITECTURES") == ARCH
    compiler = cache.get("CMAKE_CUDA_COMPILER", "")
    assert Path(compiler).name == "nvcc" and Path(compiler).is_file(), compiler
    m = re.search(r"The CUDA compiler identification is NVIDIA (\d+\.\d+)", configured.output)
    assert m, "CMake did not identify nvcc"
    assert m.group(1) == configured.cuda_version  # the nvcc cuda_deps matched cuBLAS to
    for var in ("CUDA_cublas_LIBRARY", "CUDA_cublasLt_LIBRARY"):
        lib = cache.get(var, "")
        assert lib and "NOTFOUND" not in lib and Path(lib).exists(), f"{var}={lib!r}"
        if var in configured.defines:
            assert lib == configured.defines[var]


@needs_cuda_configure
def test_ggml_cuda_target_is_generated_linked_installed_and_built(configured: Configure) -> None:
    targets, names = _codemodel(configured.build)
    assert "ggml-cuda" in targets, sorted(targets)
    cuda = targets["ggml-cuda"]
    assert cuda["type"] == "SHARED_LIBRARY"
    groups = [g for g in cuda.get("compileGroups", []) if g["language"] == "CUDA"]
    assert groups and sum(len(g["sourceIndexes"]) for g in groups) > 100, "ggml-cuda has no CUDA sources"
    arch_flags = " ".join(f["fragment"] for g in groups for f in g.get("compileCommandFragments", []))
    assert f"compute_{ARCH}" in arch_flags or f"sm_{ARCH}" in arch_flags, arch_flags[:500]
    includes = {i["path"] for g in groups for i in g.get("includes", [])}
    if "CMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES" in configured.defines:
        assert configured.defines["CMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES"] in includes, includes
    links = " ".join(f["fragment"] for f in cuda["link"]["commandFragments"])
    assert "cublas" in links and "cublasLt" in links, links
    # installed into the wheel next to libggml
    dests = {d["path"] for d in cuda.get("install", {}).get("destinations", [])}
    assert "polykv_py/_native/lib" in dests, dests
    # everything in the tree is EXCLUDE_FROM_ALL: `pip install` builds ggml-cuda only if the wheel needs it
    seen, todo = set(), ["polykv-native"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [names[d["id"]] for d in targets[name].get("dependencies", [])]
    assert "ggml-cuda" in seen, "polykv-native does not depend on ggml-cuda"
    generated = configured.build / ("build.ninja" if NINJA else "Makefile")
    assert "ggml-cuda" in generated.read_text()


@needs_cuda_configure
def test_build_info_records_cuda(configured: Configure) -> None:
    info = json.loads((configured.build / "build_info.json").read_text())
    assert "CUDA" in info["backends"] and "CPU" in info["backends"], info["backends"]
    assert info["cmake_defines"]["GGML_CUDA"] == "ON"
    assert info["cmake_defines"]["CMAKE_CUDA_ARCHITECTURES"] == ARCH


# --------------------------------------------------------------------------- cuda_deps, offline


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _fake_cublas_wheel(path: Path, *, tamper: bool = False) -> Path:
    members = {
        "nvidia/cu13/include/cublas_v2.h": b"/* v2 */\n",
        "nvidia/cu13/include/cublasLt.h": b"/* lt */\n",
        "nvidia/cu13/lib/libcublas.so.13": b"\x7fELF cublas",
        "nvidia/cu13/lib/libcublasLt.so.13": b"\x7fELF cublasLt",
        "nvidia/cu13/lib/libnvblas.so.13": b"\x7fELF nvblas",  # not needed: not extracted
    }
    record = "".join(f"{n},sha256={_b64(d)},{len(d)}\n" for n, d in members.items())
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data + (b"tampered" if tamper and name.endswith("libcublas.so.13") else b""))
        zf.writestr("nvidia_cublas-13.0.0-x.dist-info/RECORD", record)
    return path


def test_extract_takes_only_cublas_and_headers(tmp_path: Path) -> None:
    wheel = _fake_cublas_wheel(tmp_path / "nvidia_cublas-13.0.0-py3-none-manylinux1_x86_64.whl")
    dest = tmp_path / "out"
    cuda_deps.extract_cublas(wheel, dest)
    assert sorted(p.name for p in (dest / "lib").iterdir()) == [
        "libcublas.so",
        "libcublas.so.13",
        "libcublasLt.so",
        "libcublasLt.so.13",
    ]
    assert (dest / "lib" / "libcublas.so").resolve() == (dest / "lib" / "libcublas.so.13").resolve()
    assert (dest / "include" / "cublas_v2.h").is_file()
    assert cuda_deps._stamp_ok(dest)
    (dest / "lib" / "libcublasLt.so.13").write_bytes(b"short")
    assert not cuda_deps._stamp_ok(dest), "a changed file must invalidate the extraction"


def test_extract_refuses_a_member_that_does_not_match_record(tmp_path: Path) -> None:
    wheel = _fake_cublas_wheel(tmp_path / "nvidia_cublas-13.0.0-py3-none-manylinux1_x86_64.whl", tamper=True)
    with pytest.raises(cuda_deps.CudaDepsError, match="does not match the wheel's RECORD"):
        cuda_deps.extract_cublas(wheel, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_no_pin_for_unknown_cuda_major_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYKV_CACHE_DIR", str(tmp_path))
    with pytest.raises(cuda_deps.CudaDepsError, match="--wheel FILE"):
        cuda_deps.provide_cublas(99)


def test_defines_format_for_cmake_and_pip() -> None:
    d = {"CUDA_cublas_LIBRARY": "/c/lib/libcublas.so"}
    assert cuda_deps.format_defines(d, "cmake") == "-DCUDA_cublas_LIBRARY=/c/lib/libcublas.so"
    assert cuda_deps.format_defines(d, "pip") == "-C cmake.define.CUDA_cublas_LIBRARY=/c/lib/libcublas.so"

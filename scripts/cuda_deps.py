#!/usr/bin/env python3
"""cuBLAS for a CUDA build whose toolkit lacks it; prints the CMake defines that point at it.

`pip install . -C cmake.define.GGML_CUDA=ON` passes the option to ggml unchanged. ggml-cuda
links cuBLAS (CUDA::cublas, CUDA::cublasLt) and, unless GGML_CUDA_NO_VMM=ON, the driver
library libcuda (CUDA::cuda_driver). A toolkit put together from NVIDIA's pip wheels (nvcc,
runtime, CCCL) can have nvcc and no cuBLAS: configure then fails at CUDA::cublas.

This script gets the `nvidia-cublas` wheel for nvcc's major version by package name with
`python -m pip download` (pinned version and sha256, cached in $POLYKV_CACHE_DIR, never
installed), extracts only libcublas/libcublasLt and the headers into
$POLYKV_CACHE_DIR/cuda/nvidia-cublas-<version>/ (each file checked against the wheel's
RECORD), deletes the wheel, and prints the defines:

  python scripts/cuda_deps.py               # -DCUDA_cublas_LIBRARY=... (for cmake)
  python scripts/cuda_deps.py --format pip  # -C cmake.define.CUDA_cublas_LIBRARY=... (for pip)
  python scripts/cuda_deps.py --wheel FILE  # a wheel you downloaded yourself (not hash-checked)

If the toolkit already has cuBLAS it prints nothing. It also looks for libcuda and says on
stderr what to do when there is none (no NVIDIA driver, no toolkit stubs).

It uses polykv_py's pin and cache helpers: run it from the repository root with
PYTHONPATH=src (`PYTHONPATH=src python scripts/cuda_deps.py ...`), or where polykv is installed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from polykv_py.cache import cache_dir
from polykv_py.errors import PinError
from polykv_py.pins import PinnedPackage, fetch

log = logging.getLogger("cuda_deps")

STAMP = ".polykv-cublas.json"

#: nvidia-cublas wheels pinned per (CUDA major version, machine): version, file name, sha256.
CUBLAS_PINS: dict[tuple[int, str], tuple[str, str, str]] = {
    (13, "x86_64"): (
        "13.10.0.20",
        "nvidia_cublas-13.10.0.20-py3-none-manylinux1_x86_64.manylinux_2_5_x86_64.whl",
        "dcc6d63884c53d07e267ce7e6feac17b2538cebaafec5db865736c3e28e4dc84",
    ),
}
CUBLAS_PACKAGE = "nvidia-cublas"

#: wheel members we extract: the two shared libraries and the top-level headers.
_MEMBER = re.compile(r"^nvidia/[^/]+/(?P<kind>lib|include)/(?P<name>libcublas(?:Lt)?\.so(?:\.\d+)*|[^/]+\.h)$")


class CudaDepsError(RuntimeError):
    """A step failed; the message says what and what to do."""


@dataclass(frozen=True)
class Toolkit:
    nvcc: str
    version: str  # "13.0"
    root: Path | None  # the toolkit nvcc belongs to (nvcc's TOP)

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


@dataclass(frozen=True)
class Cublas:
    lib_dir: Path
    include_dir: Path
    version: str

    @property
    def cublas(self) -> Path:
        return self.lib_dir / "libcublas.so"

    @property
    def cublas_lt(self) -> Path:
        return self.lib_dir / "libcublasLt.so"


# --------------------------------------------------------------------------- the toolkit


def find_toolkit(nvcc: str | None = None) -> Toolkit:
    """nvcc's version and toolkit root; CudaDepsError if there is no nvcc."""
    exe = nvcc or shutil.which("nvcc")
    if not exe:
        raise CudaDepsError("nvcc is not on PATH: install the CUDA toolkit (or pass --nvcc PATH)")
    try:
        out = subprocess.run([exe, "--version"], check=False, capture_output=True, text=True, timeout=60).stdout
        dry = subprocess.run(
            [exe, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CudaDepsError(f"cannot run {exe}: {exc}") from exc
    m = re.search(r"release (\d+\.\d+)", out)
    if not m:
        raise CudaDepsError(f"cannot read the CUDA version from `{exe} --version`:\n{out.strip()}")
    top = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
    root = Path(top.group(1).strip()).resolve() if top else None
    return Toolkit(exe, m.group(1), root)


def _lib_dirs(root: Path) -> list[Path]:
    return [root / "lib64", root / "lib", *sorted(root.glob("targets/*/lib"))]


def toolkit_has_cublas(tk: Toolkit) -> bool:
    """True if nvcc's toolkit has libcublas and cublas_v2.h where FindCUDAToolkit looks."""
    if tk.root is None:
        return False
    lib = any((d / "libcublas.so").exists() for d in _lib_dirs(tk.root))
    header = any(
        (d / "cublas_v2.h").is_file() for d in [tk.root / "include", *sorted(tk.root.glob("targets/*/include"))]
    )
    return lib and header


def find_cuda_driver(tk: Toolkit) -> Path | None:
    """libcuda for CUDA::cuda_driver: the toolkit's stubs, else the driver's library, else None."""
    if tk.root is not None:
        for d in _lib_dirs(tk.root):
            if (d / "stubs" / "libcuda.so").exists():
                return d / "stubs" / "libcuda.so"
    try:
        ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
        cache = subprocess.run([ldconfig, "-p"], check=False, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        cache = ""
    # "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1"; skip 32-bit entries
    entries = re.findall(r"^\s*(libcuda\.so(?:\.1)?) \(([^)]*)\) => (\S+)$", cache, re.MULTILINE)
    found = {name: path for name, flags, path in entries if "64" in flags or sys.maxsize < 2**32}
    for name in ("libcuda.so", "libcuda.so.1"):
        if name in found:
            return Path(found[name])
    return None


# --------------------------------------------------------------------------- the wheel


def _record_hashes(zf: zipfile.ZipFile) -> dict[str, str]:
    record = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        raise CudaDepsError(f"{zf.filename} has no .dist-info/RECORD; is it a wheel?")
    hashes = {}
    for line in zf.read(record).decode().splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[1].startswith("sha256="):
            hashes[parts[0]] = parts[1][len("sha256=") :]
    return hashes


def _stamp_ok(dest: Path) -> bool:
    stamp = dest / STAMP
    if not stamp.is_file():
        return False
    try:
        files = json.loads(stamp.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all((dest / rel).is_file() and (dest / rel).stat().st_size == size for rel, size in files.items())


def extract_cublas(wheel: Path, dest: Path) -> None:
    """Unpack libcublas*, libcublasLt* and the headers of an nvidia-cublas wheel into dest/{lib,include}."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    files: dict[str, int] = {}
    try:
        with zipfile.ZipFile(wheel) as zf:
            hashes = _record_hashes(zf)
            for info in zf.infolist():
                m = _MEMBER.match(info.filename)
                if not m:
                    continue
                rel = f"{m['kind']}/{m['name']}"
                out = tmp / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                h = hashlib.sha256()
                with zf.open(info) as src, open(out, "wb") as dst:
                    while chunk := src.read(1 << 22):
                        h.update(chunk)
                        dst.write(chunk)
                want = hashes.get(info.filename)
                got = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
                if want != got:
                    raise CudaDepsError(f"{wheel.name}: {info.filename} does not match the wheel's RECORD")
                files[rel] = info.file_size
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, zipfile.BadZipFile):
            raise CudaDepsError(f"{wheel} is not a readable wheel: {exc}") from exc
        raise
    libs = {Path(rel).name for rel in files if rel.startswith("lib/")}
    for base in ("libcublas.so", "libcublasLt.so"):
        real = sorted(n for n in libs if n.startswith(base + "."))
        if base not in libs and not real:
            shutil.rmtree(tmp)
            raise CudaDepsError(f"{wheel.name} has no {base}*; is it an nvidia-cublas wheel?")
        if base not in libs:
            (tmp / "lib" / base).symlink_to(real[-1])  # what find_library would find in a toolkit
    if not (tmp / "include" / "cublas_v2.h").is_file():
        shutil.rmtree(tmp)
        raise CudaDepsError(f"{wheel.name} has no include/cublas_v2.h; is it an nvidia-cublas wheel?")
    (tmp / STAMP).write_text(json.dumps({"wheel": wheel.name, "files": files}, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    log.info("extracted %d files of %s into %s", len(files), wheel.name, dest)


def provide_cublas(major: int, *, wheel: Path | None = None, machine: str | None = None) -> Cublas:
    """cuBLAS for CUDA `major` in the polykv cache, fetched and extracted on first use."""
    cuda_cache = cache_dir() / "cuda"
    if wheel is not None:
        wheel = wheel.resolve()
        m = re.match(r"^([A-Za-z0-9_.]+?)-(\d[^-]*)-", wheel.name)
        version = m.group(2) if m else "local"
        dest = cuda_cache / f"nvidia-cublas-{version}-local"
        if not _stamp_ok(dest) or json.loads((dest / STAMP).read_text()).get("wheel") != wheel.name:
            extract_cublas(wheel, dest)
        return Cublas(dest / "lib", dest / "include", version)

    machine = machine or platform.machine()
    pin = CUBLAS_PINS.get((major, machine))
    if pin is None:
        known = ", ".join(f"CUDA {mj} on {mc}" for mj, mc in sorted(CUBLAS_PINS))
        raise CudaDepsError(
            f"no pinned {CUBLAS_PACKAGE} wheel for CUDA {major} on {machine} (pinned: {known}). "
            "Install cuBLAS with the CUDA toolkit, or download an nvidia-cublas wheel that matches "
            "your nvcc and pass it with --wheel FILE."
        )
    version, filename, sha256 = pin
    dest = cuda_cache / f"{CUBLAS_PACKAGE}-{version}"
    if _stamp_ok(dest):
        log.info("cuBLAS %s already in %s", version, dest)
        return Cublas(dest / "lib", dest / "include", version)
    downloads = cache_dir() / "downloads"
    log.info("fetching %s==%s (about 450 MB) with pip; it is extracted and then deleted", CUBLAS_PACKAGE, version)
    try:
        got = fetch(PinnedPackage(CUBLAS_PACKAGE, version, filename, sha256, "wheel"), downloads)
    except PinError as exc:
        raise CudaDepsError(
            f"could not get cuBLAS for CUDA {major}: {exc}\n"
            "Alternatives: install cuBLAS with the CUDA toolkit, or download the wheel on a machine that "
            f"reaches the registry (python -m pip download --no-deps --only-binary :all: {CUBLAS_PACKAGE}=={version}) "
            "and pass it with --wheel FILE."
        ) from exc
    extract_cublas(got, dest)
    got.unlink()  # the extracted files are what the build uses
    return Cublas(dest / "lib", dest / "include", version)


# --------------------------------------------------------------------------- defines


def cmake_defines(*, nvcc: str | None = None, wheel: Path | None = None, force: bool = False) -> dict[str, str]:
    """The -D defines a GGML_CUDA=ON configure needs beyond the toolkit nvcc belongs to.

    Empty when the toolkit has cuBLAS (unless force). CUDA_cublas_LIBRARY and
    CUDA_cublasLt_LIBRARY are FindCUDAToolkit's own cache variables; the headers go in through
    CMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES (only ggml-cuda's .cu/.cuh include cuBLAS, and
    FindCUDAToolkit has no cache variable for a cuBLAS include directory). A driver library
    that exists only as libcuda.so.1 (find_library looks for libcuda.so) is named as
    CUDA_cuda_driver_LIBRARY.
    """
    tk = find_toolkit(nvcc)
    defines: dict[str, str] = {}
    if force or wheel is not None or not toolkit_has_cublas(tk):
        cb = provide_cublas(tk.major, wheel=wheel)
        sonames = sorted(p.name for p in cb.lib_dir.glob("libcublas.so.*"))
        if sonames and not sonames[0].startswith(f"libcublas.so.{tk.major}"):
            raise CudaDepsError(
                f"{sonames[0]} ({cb.lib_dir}) is not cuBLAS for CUDA {tk.major}, "
                f"the version of {tk.nvcc}; use an nvidia-cublas wheel for CUDA {tk.major}"
            )
        defines.update(
            {
                "CUDA_cublas_LIBRARY": str(cb.cublas),
                "CUDA_cublasLt_LIBRARY": str(cb.cublas_lt),
                "CMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES": str(cb.include_dir),
            }
        )
    driver = find_cuda_driver(tk)
    if driver is not None and driver.name != "libcuda.so":
        defines["CUDA_cuda_driver_LIBRARY"] = str(driver)
    return defines


def format_defines(defines: dict[str, str], fmt: str) -> str:
    prefix = "-C cmake.define." if fmt == "pip" else "-D"
    return " ".join(f"{prefix}{k}={v}" for k, v in defines.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--format",
        choices=["cmake", "pip"],
        default="cmake",
        help="cmake: -DNAME=VALUE; pip: -C cmake.define.NAME=VALUE",
    )
    parser.add_argument("--nvcc", help="the nvcc to match (default: nvcc on PATH)")
    parser.add_argument("--wheel", type=Path, help="use this nvidia-cublas wheel instead of fetching the pinned one")
    parser.add_argument("--force", action="store_true", help="supply cuBLAS even if the toolkit has it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="cuda_deps: %(message)s", stream=sys.stderr)
    try:
        tk = find_toolkit(args.nvcc)
        defines = cmake_defines(nvcc=tk.nvcc, wheel=args.wheel, force=args.force)
    except CudaDepsError as exc:
        log.error("%s", exc)
        return 1
    if not defines:
        log.info("the CUDA %s toolkit at %s has cuBLAS; nothing to pass", tk.version, tk.root)
    if find_cuda_driver(tk) is None:
        log.warning(
            "no libcuda found (no NVIDIA driver, no toolkit stubs): ggml-cuda links it for its "
            "virtual-memory pool, so configure fails at CUDA::cuda_driver. Build on a machine with the "
            "driver, pass CUDA_cuda_driver_LIBRARY=/path/to/libcuda.so, or add GGML_CUDA_NO_VMM=ON."
        )
    print(format_defines(defines, args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())

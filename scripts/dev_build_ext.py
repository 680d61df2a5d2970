#!/usr/bin/env python3
"""Development only: build polykv's cffi extension in place against a hand-built tree.

The real build is `pip install .` (CMakeLists.txt). This script lets you iterate on
src/_cffi_src and src/polykv_py without a wheel: it emits the C, compiles it with the
system compiler against TREE's headers and BUILD's libllama, and writes
src/polykv_py/_native/ (build_info.json, bin/ and lib/ links) so the package runs
from the source tree with PYTHONPATH=src. Run it from the repository root with PYTHONPATH=src
too: patchtool, which it imports from scripts/ (its own directory, so on sys.path), imports
polykv_py's pin helpers:

    PYTHONPATH=src python scripts/dev_build_ext.py --tree /path/llama.cpp --build /path/build \
        [--upstream-server /path/llama-server-upstream]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import patchtool

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "src" / "polykv_py"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path, required=True)
    ap.add_argument("--build", type=Path, required=True)
    ap.add_argument("--upstream-server", type=Path)
    args = ap.parse_args()
    series = patchtool.series_hash()
    commit = patchtool.read_pin()["upstream_commit"]
    c_file = ROOT / "build" / "dev" / "_llama_cffi.c"
    c_file.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(ROOT / "src" / "_cffi_src" / "build_llama.py"), str(c_file)], check=True)
    libdir = args.build.resolve() / "bin"
    out = PKG / ("_llama_cffi" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = [
        "cc",
        "-shared",
        "-fPIC",
        "-O1",
        str(c_file),
        "-o",
        str(out),
        f"-I{args.tree / 'include'}",
        f"-I{args.tree / 'ggml' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        f'-DPOLYKV_UPSTREAM_COMMIT="{commit}"',
        f'-DPOLYKV_PATCH_SERIES_SHA256="{series}"',
        f"-L{libdir}",
        "-lllama",
        f"-Wl,-rpath,{libdir}",
    ]
    subprocess.run(cmd, check=True)
    native = PKG / "_native"
    (native / "bin").mkdir(parents=True, exist_ok=True)
    for name, src in (("llama-server", libdir / "llama-server"), ("llama-server-upstream", args.upstream_server)):
        link = native / "bin" / name
        link.unlink(missing_ok=True)
        if src:
            link.symlink_to(Path(src).resolve())
    lib = native / "lib"
    if lib.is_symlink():
        lib.unlink()
    if not lib.exists():
        lib.symlink_to(libdir)
    info = {
        "upstream_commit": commit,
        "patch_series_sha256": series,
        "dev_build": True,
        "llama_cpp_source": str(args.tree.resolve()),
        "patches": [p.name for p in patchtool.patch_files()],
        "backends": ["CPU"],
        "cpu_flags": [],
        "cmake_defines": {},
        "build_type": "dev",
    }
    (native / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"built {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Emit the C source of the cffi extension ``polykv_py._llama_cffi`` (API mode, out-of-line).

This script only writes C; the native build (CMakeLists.txt) compiles it against
llama.h and links it to libllama.  The declarations live in ``llama_cdef.h`` beside
this file: partial structs (``...;``) let the C compiler lay out llama.h's structs,
so no layout is copied by hand.

    python build_llama.py OUT.c
"""

from __future__ import annotations

import sys
from pathlib import Path

import cffi

HERE = Path(__file__).resolve().parent
MODULE = "polykv_py._llama_cffi"

# The build stamps are compile-time defines set by CMake; _ffi.py compares them with
# the installed build-info record and refuses a mismatched extension.
SOURCE = r"""
#include "llama.h"

#ifndef POLYKV_UPSTREAM_COMMIT
#error "POLYKV_UPSTREAM_COMMIT must be defined by the build"
#endif
#ifndef POLYKV_PATCH_SERIES_SHA256
#error "POLYKV_PATCH_SERIES_SHA256 must be defined by the build"
#endif

static const char * polykv_upstream_commit(void) { return POLYKV_UPSTREAM_COMMIT; }
static const char * polykv_patch_series_sha256(void) { return POLYKV_PATCH_SERIES_SHA256; }
"""

STAMPS_CDEF = """
const char * polykv_upstream_commit(void);
const char * polykv_patch_series_sha256(void);
"""


def make_ffibuilder() -> cffi.FFI:
    ffibuilder = cffi.FFI()
    ffibuilder.cdef((HERE / "llama_cdef.h").read_text())
    ffibuilder.cdef(STAMPS_CDEF)
    ffibuilder.set_source(MODULE, SOURCE)
    return ffibuilder


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write(f"{__doc__}\n")
        return 2
    make_ffibuilder().emit_c_code(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

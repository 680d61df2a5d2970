#!/usr/bin/env python3
"""The fan-out benchmark grid (same as ``polykv bench``), writing into bench/results/.

    python bench/bench_fanout.py            # full grid: N 1..16, P 512/2048/4096, all systems
    python bench/bench_fanout.py --quick    # N 1,2,4,8 at P=2048, short capacity probe

See ``python bench/bench_fanout.py --help`` and :mod:`polykv_py.harness.benchmark`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from polykv_py.harness.benchmark import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--out" not in argv:
        argv += ["--out", str(Path(__file__).resolve().parent / "results")]
    sys.exit(main(argv))

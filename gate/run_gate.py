#!/usr/bin/env python3
"""Run the polykv gate: ``python gate/run_gate.py --report out.json`` (see ``--help``).

Thin wrapper over :func:`polykv_py.harness.gate.main`; exits 0 only when every check passed.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from polykv_py.harness.gate import main
except ImportError:  # running from a source checkout without `pip install .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from polykv_py.harness.gate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

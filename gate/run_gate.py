#!/usr/bin/env python3
"""Run the polykv gate: ``python gate/run_gate.py --report out.json`` (see ``--help``).

Thin wrapper over :func:`polykv_py.harness.gate.main` (the same as ``polykv gate``); exits 0 only
when every check passed. It needs the installed package (``pip install .``): the gate runs the
native build's servers, which a source checkout alone does not have.
"""

from __future__ import annotations

import sys

from polykv_py.harness.gate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

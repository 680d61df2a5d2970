"""``polykv bench``: the fan-out benchmark of a source checkout, when it is importable.

The benchmarks are not part of the wheel: they are the checkout's ``bench/`` package, run from the
checkout's root as ``python -m bench.fanout``, ``python -m bench.decode`` ... This command runs
``bench.fanout`` when ``bench`` is on the import path (``PYTHONPATH=<checkout>``) and hands it every
argument after ``bench`` (``polykv bench --help`` is the benchmark's help); otherwise it says where the
benchmarks run. It never edits the import path itself.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Any

#: What ``polykv bench`` says, exiting 2, where no ``bench`` package can be imported.
NOT_A_CHECKOUT = (
    "benchmarks run from a source checkout, in its root: python -m bench.fanout ... "
    "(or PYTHONPATH=<checkout> polykv bench ...)"
)


def load_fanout() -> ModuleType | None:
    """``bench.fanout`` from the import path, or None when it is not there."""
    try:
        return importlib.import_module("bench.fanout")
    except ModuleNotFoundError as exc:
        if exc.name not in ("bench", "bench.fanout"):
            raise  # bench is there but something it imports is not: say so
    return None


def _cmd_bench(args: argparse.Namespace) -> int:
    fanout = load_fanout()
    if fanout is None:
        sys.stderr.write(f"polykv bench: {NOT_A_CHECKOUT}\n")
        return 2
    return int(fanout.main(list(args.forward_args), prog="polykv bench"))


def register(subparsers: Any) -> None:
    """Add ``bench`` to the ``polykv`` command's subparsers; its arguments reach the benchmark as they are
    (``forward_args``, filled by :func:`polykv_py.cli.app.main`)."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark the fan-out against the stock server and the in-process engine (source checkout)",
        description=__doc__,
        add_help=False,  # --help is the benchmark's
    )
    p.set_defaults(func=_cmd_bench, forward_args=[])

"""``polykv bench``: the fan-out benchmark of a source checkout.

The benchmarks are not part of the wheel: they are the checkout's ``bench/`` package
(``python -m bench.fanout``, ``python -m bench.decode`` ...). This command imports ``bench``
only when it runs, and hands it every argument after ``bench`` (``polykv bench --help`` is the
benchmark's help). ``bench`` is found on the import path, else in the current directory when
that is a polykv checkout (``bench/fanout.py`` next to ``src/polykv_py``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

#: What ``polykv bench`` says, exiting 2, where no ``bench`` package can be imported.
NOT_A_CHECKOUT = (
    "benchmarks run from a source checkout: python -m bench.fanout ... "
    "(in the checkout's root, where `polykv bench` finds them too)"
)


def _is_checkout(root: Path) -> bool:
    return (root / "bench" / "fanout.py").is_file() and (root / "src" / "polykv_py").is_dir()


def load_fanout(cwd: Path | None = None) -> ModuleType | None:
    """``bench.fanout``, or None when neither the import path nor ``cwd`` (a checkout) has it."""
    try:
        return importlib.import_module("bench.fanout")
    except ModuleNotFoundError as exc:
        if exc.name not in ("bench", "bench.fanout"):
            raise  # bench is there but something it imports is not: say so
    root = (cwd or Path.cwd()).resolve()
    if not _is_checkout(root) or "bench" in sys.modules:
        return None
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        return importlib.import_module("bench.fanout")
    except ModuleNotFoundError:
        sys.path.remove(str(root))
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

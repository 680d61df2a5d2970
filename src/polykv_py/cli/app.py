"""The ``polykv`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from ..errors import PolykvError

log = logging.getLogger("polykv")


def _cmd_info(args: argparse.Namespace) -> int:
    from ..native import build_info, server_binary

    info = dict(build_info())
    for kind in ("patched", "upstream"):
        try:
            info[f"{kind}_server"] = str(server_binary(kind))
        except PolykvError as exc:
            info[f"{kind}_server"] = f"missing: {exc}"
    print(json.dumps(info, indent=2))
    return 0


def _cmd_fetch_model(args: argparse.Namespace) -> int:
    from ..models import KNOWN_MODELS, known_model_path

    print(known_model_path(KNOWN_MODELS[args.name]))
    return 0


def _cmd_gate(args: argparse.Namespace) -> int:
    from ..harness import gate

    return gate.run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polykv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="show the native build's record and binary paths")
    p.set_defaults(func=_cmd_info)

    from ..models import DEFAULT_MODEL, KNOWN_MODELS

    p = sub.add_parser("fetch-model", help="download and verify a known model (the default model if none is named)")
    p.add_argument(
        "name",
        nargs="?",
        default=DEFAULT_MODEL.name,
        choices=sorted(KNOWN_MODELS),
        help="; ".join(f"{m.name}: {m.description}" for m in KNOWN_MODELS.values()),
    )
    p.set_defaults(func=_cmd_fetch_model)

    from .serve import register as register_serve

    register_serve(sub)  # `polykv serve`

    from ..harness import gate

    p = sub.add_parser(
        "gate",
        help="prove the patched server safe: default output, share hit, fallback miss",
        description=gate.__doc__.split("\n\n")[0],
    )
    gate.add_arguments(p)
    p.set_defaults(func=_cmd_gate)

    from .run import register as register_run

    register_run(sub)  # `polykv run`: the main job

    from .bench import register as register_bench

    register_bench(sub)  # `polykv bench`: the fan-out benchmark of a source checkout

    from .pools import register as register_pools

    register_pools(sub)  # `polykv pools list|clear|status`

    from .cluster import register as register_cluster

    register_cluster(sub)  # `polykv cluster`, `polykv cluster-status`
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest:
        if not hasattr(args, "forward_args"):  # only `polykv bench` hands its arguments on
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.forward_args = rest
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    if not args.verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except PolykvError as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

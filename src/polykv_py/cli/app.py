"""The ``polykv`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import PolykvError
from ..presets import POOL_AUTO, SERVE_AGENT_SLOTS, SERVE_AUTO_POOLS, SERVE_DEFAULTS

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
    from ..models import default_model_path

    print(default_model_path())
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from ..serve import ServeOptions, serve
    from ._args import options_from_args

    return serve(
        options_from_args(ServeOptions, args, server_args=list(args.server_args), pools=list(args.pools or []))
    )


def _cmd_gate(args: argparse.Namespace) -> int:
    from ..harness import gate

    return gate.run_from_args(args)


def _pool_file(kind: str) -> Callable[[str], tuple[Any, str]]:
    """argparse ``type`` that tags a pool file with how it is primed (keeps --pool and --pool-chat in order)."""
    return lambda path: (kind, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polykv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="show the native build's record and binary paths")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("fetch-model", help="download and verify the default model into the cache")
    p.set_defaults(func=_cmd_fetch_model)

    p = sub.add_parser(
        "serve",
        help="run the patched llama-server with pool-friendly defaults, its pools primed",
        description="Start the patched llama-server, prime one reserved pool slot per --pool/--pool-chat file "
        "(slots 0, 1, ... in the order given), then print that it is ready and wait; SIGTERM/SIGINT stop it.",
    )
    p.add_argument("--model", "-m", help="GGUF path (default: $POLYKV_MODEL or the default model)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default: 127.0.0.1, loopback only; another address must be given explicitly)",
    )
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=os.environ.get("POLYKV_API_KEY"), help="require this API key")
    p.add_argument("--upstream", action="store_true", help="run the stock (pristine) server instead, with its own "
                   "defaults and the same slots, KV cells, threads and chat template (for comparisons)")  # fmt: skip
    p.add_argument("--no-defaults", action="store_true", help=f"don't add {' '.join(SERVE_DEFAULTS)}")
    for flag, kind, what in (
        ("--pool", "text", "this file's text (completion prompts that start with it share it)"),
        ("--pool-chat", "chat", "the chat template's rendering of one system message with this file's text "
         "(chat requests whose first message is that system message share it)"),
    ):  # fmt: skip
        p.add_argument(flag, dest="pools", action="append", type=_pool_file(kind), metavar="FILE",
                       help=f"reserve a pool slot holding {what}; repeatable")  # fmt: skip
    p.add_argument("--pool-salt", metavar="SALT", help="prime the pools with cache_salt SALT: only requests "
                   "with the same cache_salt share them")  # fmt: skip
    p.add_argument("--pool-cache", metavar="DIR", help="restore the pools (and the prefixes --share-any promoted "
                   "before) from pool files here, save computed ones (the server's --slot-save-path; default "
                   "$POLYKV_CACHE_DIR/pools)")  # fmt: skip
    p.add_argument("--no-pool-cache", action="store_true", help="always compute the pools; save nothing")
    auto = p.add_mutually_exclusive_group()
    auto.add_argument(
        "--pool-auto",
        dest="pool_auto",
        action="store_const",
        const=True,
        default=None,
        help=f"add {POOL_AUTO} (plain requests share the pools; default: if the server knows it)",
    )
    auto.add_argument(
        "--no-pool-auto",
        dest="pool_auto",
        action="store_const",
        const=False,
        help=f"don't add {POOL_AUTO}: only requests with shared_pool_slot share",
    )
    p.add_argument("--agent-slots", type=int, default=SERVE_AGENT_SLOTS,
                   help=f"slots besides the pools (-np = pools + this; default {SERVE_AGENT_SLOTS})")  # fmt: skip
    p.add_argument("--reserve-pools", type=int, default=0, metavar="K",
                   help="reserve at least K pool slots (0..K-1), e.g. for pools that clients prime through a gateway "
                   "(docs/cluster.md); --pool files fill the first ones")  # fmt: skip
    p.add_argument("--auto-pools", type=int, default=SERVE_AUTO_POOLS, metavar="K",
                   help="with --share-any (the default), K more reserved pool slots for the prefixes it promotes: "
                   f"saved to the pool cache and restored at start (default {SERVE_AUTO_POOLS})")  # fmt: skip
    p.add_argument("--log-dir", help="directory for the llama-server log (default: a temporary directory)")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="more llama-server flags, after --")
    p.set_defaults(func=_cmd_serve)

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

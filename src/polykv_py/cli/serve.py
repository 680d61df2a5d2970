"""``polykv serve``: its command line (the launcher itself is :mod:`polykv_py.serve`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from ..presets import POOL_AUTO, SERVE_AGENT_SLOTS, SERVE_AUTO_POOLS, SERVE_DEFAULTS


def _cmd_serve(args: argparse.Namespace) -> int:
    from ..serve import ServeOptions, serve
    from ._args import options_from_args

    return serve(
        options_from_args(ServeOptions, args, server_args=list(args.server_args), pools=list(args.pools or []))
    )


def _pool_file(kind: str) -> Callable[[str], tuple[Any, str]]:
    """argparse ``type`` that tags a pool file with how it is primed (keeps --pool and --pool-chat in order)."""
    return lambda path: (kind, path)


def register(subparsers: Any) -> None:
    """Add ``serve`` to the ``polykv`` command's subparsers."""
    p = subparsers.add_parser(
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

"""``polykv pools``: the pool cache on disk (list, clear) and a server's reserved pools (status)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..pools import PoolCache


def _cache(args: argparse.Namespace) -> PoolCache:
    return PoolCache(args.dir) if args.dir else PoolCache.default()


def _cmd_list(args: argparse.Namespace) -> int:
    cache = _cache(args)
    entries, partials = cache.entries(), cache.partials()
    if args.json:
        doc = {
            "directory": str(cache.directory),
            "max_bytes": cache.max_bytes,
            "total_bytes": cache.total_bytes(),
            "files": [e.to_json() for e in entries],
            "partial_files": [e.to_json() for e in partials],
        }
        print(json.dumps(doc, indent=2))
        return 0
    part = f" (and {len(partials)} partial file(s) of saves in progress or killed)" if partials else ""
    print(f"pool cache {cache.directory}: {len(entries)} file(s){part}, {cache.total_bytes() / 2**20:.1f} MiB "
          f"of {cache.max_bytes / 2**20:.0f} MiB")  # fmt: skip
    for e in entries:
        j = e.to_json()
        tokens = "unreadable header" if e.n_tokens is None else f"{e.n_tokens} tokens"
        print(f"  {e.name}  {e.size / 2**20:8.1f} MiB  {tokens:>14}  last used {j['last_use']}  "
              f"{e.model or '?'} ({e.created_by or '?'})")  # fmt: skip
    return 0


def _cmd_clear(args: argparse.Namespace) -> int:
    cache = _cache(args)
    n = cache.clear()
    print(f"removed {n} file(s) from {cache.directory}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from ..client import Client

    with Client(args.url, api_key=args.api_key) as client:
        pools = client.pools()
    if args.json:
        print(json.dumps([p.__dict__ for p in pools], indent=2))
        return 0
    if not pools:
        print(f"{args.url}: no reserved pools (a patched server with --pool-slots reports them)")
    for p in pools:
        ago = "never" if p.last_use_s_ago is None else f"{p.last_use_s_ago:.1f}s ago"
        salt = "unsalted" if p.salted is False else "salted" if p.salted is True else "cells of several salts"
        src = f", restored from {p.restored_from}" if p.restored_from else ""
        if not p.resident:
            state = "not resident"
        elif p.n_tokens is None:
            state = "resident (its tokens are shown only to holders of its salt)"
        else:
            state = f"{p.n_tokens} tokens resident"
        print(f"pool slot {p.slot}: {state}, {salt}, {p.hits} hits, {p.sharers} sharers holding its cells, "
              f"last use {ago}{src}")  # fmt: skip
    return 0


def register(subparsers: Any) -> None:
    """Add ``pools list|clear|status`` to the ``polykv`` command's subparsers."""
    p = subparsers.add_parser("pools", help="the pool cache (saved pools) and a server's reserved pools")
    sub = p.add_subparsers(dest="pools_command", required=True)
    for name, func, what in (
        ("list", _cmd_list, "list the pool files in the cache, most recently used first"),
        ("clear", _cmd_clear, "remove every pool file (and partial files of killed saves) from the cache"),
    ):
        q = sub.add_parser(name, help=what, description=what)
        q.add_argument("--dir", help="the cache directory (default: $POLYKV_CACHE_DIR/pools)")
        if name == "list":
            q.add_argument("--json", action="store_true")
        q.set_defaults(func=func)
    q = sub.add_parser("status", help="a running server's reserved pools: tokens, salt, hits, sharers, last use")
    q.add_argument("--url", required=True, help="the patched llama-server")
    q.add_argument("--api-key", default=os.environ.get("POLYKV_API_KEY"))
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_cmd_status)

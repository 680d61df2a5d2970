"""``polykv cluster``: K patched replicas and the smg gateway in front of them, on this machine."""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from ..errors import PolykvError

if TYPE_CHECKING:
    from ..cluster import ClusterConfig

log = logging.getLogger("polykv.cluster")


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The replicas' shape and the gateway's routing for parsed ``polykv cluster`` options."""
    from ..cluster import ClusterConfig
    from ..gateway import GatewayOptions
    from ._args import options_from_args

    return options_from_args(
        ClusterConfig,
        args,  # --replicas, --pools-per-replica, --agent-slots, --ctx, --threads, --model, --alias
        extra_args=tuple(args.server_arg or ()),
        shared_decode=not args.no_shared_decode,
        share_any=not args.no_share_any,
        gateway=options_from_args(GatewayOptions, args),  # --policy, --assignment-mode
    )


def _cmd_cluster(args: argparse.Namespace) -> int:
    from ..cluster import Cluster
    from ..llama_server import Stop, stop_on_signals
    from ..pools import PoolCache

    config = cluster_config(args)
    cache = PoolCache(args.pool_cache) if args.pool_cache else PoolCache.default()
    cluster = Cluster(config, pool_cache=cache, gateway_port=args.port)
    with stop_on_signals():
        try:
            cluster.start()
            print(
                f"polykv cluster: gateway at {cluster.url}/v1 (policy {args.policy}), model {args.alias!r}, "
                f"{args.replicas} replicas: {' '.join(cluster.replica_urls)}; pool files in {cache.directory}\n"
                f"  try: polykv run --gateway {cluster.url} --base examples/design-doc.md "
                "--agents examples/agents.txt",
                flush=True,
            )
            while True:
                time.sleep(args.watch_interval)
                for i, r in enumerate(cluster.replicas):
                    if not r.is_alive() and args.restart_dead:
                        log.warning("replica %d (%s) is down: starting it again", i, r.url)
                        cluster.restart(i)
        except Stop as stop:
            log.info("%s: stopping the cluster", stop)
            return 0
        except PolykvError as exc:
            log.error("%s", exc)
            return 1
        finally:
            cluster.stop()


def _cmd_cluster_status(args: argparse.Namespace) -> int:
    """Per replica behind a gateway: health (the gateway's view) and the pools it holds."""
    from ..client import Client
    from ..gateway import Gateway

    rows: list[dict[str, Any]] = []
    for w in Gateway.list_workers(args.gateway):
        entry: dict[str, Any] = {"url": w.get("url"), "healthy": w.get("is_healthy"), "load": w.get("load")}
        try:
            with Client(str(w.get("url")), api_key=args.api_key) as c:
                entry["pools"] = [p.__dict__ for p in c.pools() if p.n_tokens]
        except PolykvError as exc:
            entry["error"] = str(exc).splitlines()[0]
        rows.append(entry)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for e in rows:
        state = "healthy" if e["healthy"] else "NOT healthy"
        pools = ", ".join(f"slot {p['slot']}: {p['n_tokens']} tokens, {p['hits']} hits" for p in e.get("pools", []))
        print(f"{e['url']}  {state}, load {e['load']}; pools: {pools or e.get('error') or 'none'}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``cluster`` and ``cluster-status`` to the ``polykv`` command's subparsers."""
    p = subparsers.add_parser(
        "cluster",
        help="start K patched replicas and the smg gateway in front of them (needs the cluster extra)",
        description="Replicas as `polykv serve` starts them (reserved pools, --alias MODEL, one pool-file "
        "directory), behind `smg launch --policy manual`: requests with the pool's routing key "
        "(X-SMG-Routing-Key; `polykv run --gateway`) stick to one replica. A replica that dies is started "
        "again. Ctrl-C stops everything.",
    )
    p.add_argument("--replicas", "-k", type=int, default=3, help="replicas (default 3)")
    p.add_argument("--pools-per-replica", type=int, default=3, help="reserved pool slots per replica (default 3)")
    p.add_argument("--agent-slots", type=int, default=8, help="agent slots per replica (default 8)")
    p.add_argument("--ctx", type=int, default=16384, help="KV cells per replica (default 16384)")
    p.add_argument("--threads", "-t", type=int, default=1, help="CPU threads per replica (default 1)")
    p.add_argument("--model", "-m", help="GGUF path (default: $POLYKV_MODEL or the default model)")
    p.add_argument("--alias", default="polykv", help="the model id every replica serves (default polykv)")
    p.add_argument("--port", type=int, default=30000, help="the gateway's port (default 30000)")
    p.add_argument(
        "--policy",
        default="manual",
        choices=["manual", "cache_aware", "round_robin", "random", "least_load", "power_of_two", "prefix_hash"],
        help="smg routing policy (default manual: the routing key pins a pool to a replica)",
    )
    p.add_argument(
        "--assignment-mode",
        default="min_group",
        choices=["min_group", "min_load", "random"],
        help="manual policy: the replica a new key goes to (default min_group: fewest keys)",
    )
    p.add_argument("--pool-cache", metavar="DIR", help="the replicas' pool-file directory (default the pool cache)")
    p.add_argument("--server-arg", action="append", help="extra llama-server flag for every replica (repeatable)")
    p.add_argument(
        "--no-shared-decode", action="store_true", help="replicas decode with upstream's attention kernel (default: on)"
    )
    p.add_argument(
        "--no-share-any",
        action="store_true",
        help="replicas share only declared pools (default: --share-any, any prefix)",
    )
    p.add_argument("--no-restart-dead", dest="restart_dead", action="store_false", help="leave dead replicas down")
    p.add_argument("--watch-interval", type=float, default=2.0, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_cluster)

    p = subparsers.add_parser(
        "cluster-status",
        help="the replicas behind a gateway: health and the pools each holds",
    )
    p.add_argument("gateway", help="the gateway's URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None, help="API key of the replicas")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_cluster_status)

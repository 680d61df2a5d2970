"""The ``polykv`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence

from ..errors import PolykvError
from ..presets import SERVE_DEFAULTS

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


def _is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost, a UNIX socket)."""
    import ipaddress

    if host == "localhost" or host.endswith(".sock"):
        return True
    try:
        return all(ipaddress.ip_address(h.strip().strip("[]")).is_loopback for h in host.split(","))
    except ValueError:
        return False


def _cmd_serve(args: argparse.Namespace) -> int:
    from ..models import resolve_model
    from ..native import server_binary
    from ..server import _redact

    binary = server_binary("upstream" if args.upstream else "patched")
    extra = list(args.server_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    cmd = [str(binary), "-m", str(resolve_model(args.model)), "--host", args.host, "--port", str(args.port)]
    defaults = [] if args.no_defaults else list(SERVE_DEFAULTS)
    if args.upstream:  # the reference server would parse --pool-slots (shared libllama-common) and ignore it
        i = defaults.index("--pool-slots")
        del defaults[i : i + 2]
    cmd += defaults + extra
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if not _is_loopback(args.host):
        log.warning(
            "binding %s: reachable from other machines%s",
            args.host,
            "" if args.api_key else " with no API key (anyone can prompt, prime and erase slots)",
        )
    log.info("exec %s", " ".join(_redact(cmd)))
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
    return 0  # pragma: no cover - execv does not return


def _cmd_gate(args: argparse.Namespace) -> int:
    from ..harness import gate

    return gate.run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polykv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="show the native build's record and binary paths")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("fetch-model", help="download and verify the default model into the cache")
    p.set_defaults(func=_cmd_fetch_model)

    p = sub.add_parser("serve", help="run the patched llama-server with pool-friendly defaults")
    p.add_argument("--model", "-m", help="GGUF path (default: $POLYKV_MODEL or the default model)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default: 127.0.0.1, loopback only; another address must be given explicitly)",
    )
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=os.environ.get("POLYKV_API_KEY"), help="require this API key")
    p.add_argument("--upstream", action="store_true", help="run the reference (unpatched) server instead")
    p.add_argument("--no-defaults", action="store_true", help=f"don't add {' '.join(SERVE_DEFAULTS)}")
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

    from .fanout import register as register_fanout

    register_fanout(sub)  # `polykv run` (the main job) and `polykv bench`
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
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

"""The polykv command line: dispatch and argument handling (no server started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.systems import SYSTEMS
from polykv_py.cli import app as cli
from polykv_py.harness import gate
from polykv_py.presets import (
    NO_SHARE_ANY,
    NO_SHARED_DECODE,
    POOL_AUTO,
    SERVE_AGENT_SLOTS,
    SERVE_DEFAULTS,
    SHARE_ANY,
    SHARED_DECODE,
    serve_pool_args,
    serve_server,
)


def test_gate_options_reach_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(gate, "run_from_args", lambda args: seen.append((str(args.report), args.sharers)) or 7)
    assert cli.main(["gate", "--report", "r.json", "--sharers", "2"]) == 7
    assert seen == [("r.json", 2)]


def test_serve_defaults_keep_the_pool_resident() -> None:
    for flag in ("-kvu", "--no-clear-idle"):
        assert flag in SERVE_DEFAULTS
    assert SERVE_DEFAULTS[SERVE_DEFAULTS.index("--cache-ram") + 1] == "0"


def test_unknown_command_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["no-such-command"])
    assert exc.value.code == 2


def test_serve_keeps_pool_files_in_order_with_their_kind() -> None:
    args = cli.build_parser().parse_args(["serve", "--pool", "a", "--pool-chat", "b", "--pool", "c", "--", "-c", "9"])
    assert args.pools == [("text", "a"), ("chat", "b"), ("text", "c")]
    assert args.server_args == ["--", "-c", "9"] and args.pool_auto is None
    assert cli.build_parser().parse_args(["serve", "--no-pool-auto"]).pool_auto is False


def test_serve_pool_args_reserve_the_pools_and_add_agent_slots() -> None:
    assert serve_pool_args(0) == ["--pool-slots", "0", "-np", str(SERVE_AGENT_SLOTS + 1)]
    assert serve_pool_args(2, 3, pool_auto=True) == ["--pool-slots", "0,1", "-np", "5", POOL_AUTO]
    with pytest.raises(ValueError, match="agent_slots >= 1"):
        serve_pool_args(1, 0)


def test_serve_server_is_polykv_serve_with_pools(tmp_path: Path, fake_model: Path) -> None:
    srv = serve_server(2, agent_slots=2, ctx=4096, threads=1, binary=tmp_path / "llama-server", model=fake_model)
    cmd = srv.command(8080)
    flags = [a for a in SERVE_DEFAULTS if a.startswith("-")]
    assert all(f in cmd for f in flags), [f for f in flags if f not in cmd]
    assert cmd[cmd.index("-c") + 1] == "4096" and cmd[cmd.index("-t") + 1] == "1"
    assert cmd[-7:] == ["--pool-slots", "0,1", "-np", "4", POOL_AUTO, SHARED_DECODE, SHARE_ANY]
    off = serve_server(1, shared_decode=False, share_any=False, binary=tmp_path / "llama-server", model=fake_model)
    off_cmd = off.command(8080)
    assert (
        off_cmd[-2:] == [NO_SHARED_DECODE, NO_SHARE_ANY] and SHARED_DECODE not in off_cmd and SHARE_ANY not in off_cmd
    )


def test_polykv_run_and_cluster_share_any_prefix_unless_told_not_to() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["run", "x"]).no_share_any is False
    assert parser.parse_args(["run", "x", "--no-share-any"]).no_share_any is True
    assert parser.parse_args(["cluster", "--no-share-any"]).no_share_any is True
    assert SHARE_ANY in SERVE_DEFAULTS


def test_polykv_run_and_cluster_decode_over_shared_cells_unless_told_not_to() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["run", "x"]).no_shared_decode is False
    assert parser.parse_args(["run", "x", "--no-shared-decode"]).no_shared_decode is True
    assert parser.parse_args(["cluster", "--no-shared-decode"]).no_shared_decode is True
    assert SHARED_DECODE in SERVE_DEFAULTS
    assert SHARED_DECODE in SYSTEMS["patched"].flags and SHARED_DECODE in SYSTEMS["dropin"].flags


def test_polykv_cluster_options_reach_the_cluster_config() -> None:
    from polykv_py.cli.cluster import cluster_config
    from polykv_py.cluster import ClusterConfig
    from polykv_py.gateway import GatewayOptions

    argv = ["cluster", "-k", "2", "--pools-per-replica", "1", "--agent-slots", "3", "--ctx", "2048", "-t", "2",
            "-m", "m.gguf", "--alias", "a", "--policy", "round_robin", "--assignment-mode", "min_load",
            "--server-arg=-fa", "--server-arg=on", "--no-shared-decode"]  # fmt: skip
    cfg = cluster_config(cli.build_parser().parse_args(argv))
    gateway = GatewayOptions(policy="round_robin", assignment_mode="min_load")
    assert cfg == ClusterConfig(replicas=2, pools_per_replica=1, agent_slots=3, ctx=2048, threads=2, model="m.gguf",
                                alias="a", shared_decode=False, extra_args=("-fa", "on"), gateway=gateway)  # fmt: skip
    defaults = cluster_config(cli.build_parser().parse_args(["cluster"]))
    assert defaults.shared_decode and defaults.pool_auto and not defaults.track_kv and defaults.extra_args == ()
    assert defaults.gateway == GatewayOptions()

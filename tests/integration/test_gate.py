"""The gate on the real binaries and the default model (smaller base and fewer tokens than `polykv gate`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from polykv_py.harness.gate import GateConfig, main, run_gate

pytestmark = pytest.mark.integration


@pytest.mark.slow  # the six checks: a fresh server per sharer and per reference
def test_gate_passes(
    patched_server_bin: Path,
    upstream_server_bin: Path,
    model_path: Path,
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    cfg = GateConfig(
        model=model_path,
        patched_bin=patched_server_bin,
        upstream_bin=upstream_server_bin,
        n_predict=8,
        base_tokens=400,
        n_sharers=3,
        ctx=4096,
        log_dir=tmp_path,
        fresh_info=False,
    )
    report = run_gate(cfg)
    summaries = {name: (c["ok"], c["summary"]) for name, c in report["checks"].items()}
    assert report["ok"], json.dumps(summaries, indent=2)
    share = report["checks"]["share_hit"]
    # trap 1: P comes from the tokenized full prompts, not from the base tokenized alone
    assert all(p < share["info"]["base_tokens_alone"] for p in share["info"]["shared_prefix_p"])
    assert all(c["shared_prefix"]["status"] == "hit" for c in share["cases"])
    # the concurrent sharers hit, and the two greedy ones answered like each alone (LAYOUT margins: identical
    # or a near tie); the seeded one is compared byte for byte in the exact phase only
    together = share["info"]["together"]
    record_property("together_vs_alone", together["vs_alone"])
    assert [c["shared_prefix"]["status"] for c in together["cases"]] == ["hit"] * 3
    assert [c["vs_alone"] in ("identical", "near_tie") for c in together["cases"]] == [True, False, True], together
    assert together["vs_alone"]["not_compared_sampled"] == 1 and together["vs_alone"]["different"] == 0
    assert all(c["shared_prefix"]["status"] == "not_resident" for c in report["checks"]["fallback_miss"]["cases"])
    # the reporting run with --shared-decode: the path ran, and no answer is different from the run without it
    sd = report["checks"]["shared_decode"]
    record_property("shared_decode", [c["verdict"] for c in sd["cases"]])
    assert sd["info"]["server_counters"]["ops"] > 0 and sd["info"]["server_counters"]["enabled"] is True
    assert [c["verdict"] for c in sd["cases"]].count("not_compared_sampled") == 1
    assert all(c["verdict"] != "different" for c in sd["cases"]), sd["cases"]
    # zero-config: all at once, all but one shared and the server computed at most P + the suffixes; one at a
    # time, each shared exactly its prefix with the leader and answered byte for byte as the reference
    sa = report["checks"]["share_any"]
    together_any = sa["info"]["together"]
    assert together_any["hits"] == 2 and together_any["prompt_tokens_computed"] <= together_any["bound_P_plus_suffixes"]
    exact = [c for c in sa["cases"] if "cache_salt" not in c["name"]]
    assert [c["shared_prefix"]["shared"] for c in exact] == sa["info"]["p_with_leader"]
    assert all(c["identical_to_reference"] for c in sa["cases"]), sa["cases"]
    salted = [c for c in sa["cases"] if "cache_salt" in c["name"]]
    assert len(salted) == 1 and salted[0]["shared_prefix"] is None


def test_share_check_on_reference_server_fails_clearly(
    upstream_server_bin: Path, model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    argv = [
        "--checks",
        "share_hit",
        "--share-server",
        "upstream",
        "--upstream-bin",
        str(upstream_server_bin),
        "--model",
        str(model_path),
        "--base-tokens",
        "200",
        "--sharers",
        "1",
        "--n-predict",
        "4",
        "--ctx",
        "2048",
        "--skip-fresh-info",
        "--log-dir",
        str(tmp_path),
        "--report",
        str(out),
    ]
    assert main(argv) == 1
    report = json.loads(out.read_text())
    check = report["checks"]["share_hit"]
    assert not report["ok"] and not check["ok"]
    assert "no shared_prefix field" in check["summary"]
    assert "FAIL  share_hit" in capsys.readouterr().out

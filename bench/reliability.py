"""Reliability report: the load run (issue 4 section 2) plus the fault and hostile-input suites.

    python -m bench.reliability                 # 16 slots, 2,048-token pool, 64 agents, 10 rounds
    python -m bench.reliability --rounds 2 --agents 16 --skip-suites   # a quick look

Writes bench/results/reliability.json and reliability.md (a readable table).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from polykv_py.harness.compare import LAYOUT
from polykv_py.harness.loadtest import LoadConfig, LoadReport, run_load

from . import RESULTS
from .machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
SUITES = [
    "tests/integration/test_faults.py",
    "tests/integration/test_hostile_input.py",
    "tests/integration/test_pool_pinning.py",
    "tests/integration/test_security.py",
]


def run_suites(paths: list[str]) -> dict[str, Any]:
    """Run the fault/hostile/pinning tests; tests, failures and the inputs the hostile suite tried."""
    with tempfile.TemporaryDirectory() as tmp:
        xml, inputs = Path(tmp) / "junit.xml", Path(tmp) / "outcomes.json"
        env = {**os.environ, "POLYKV_RELIABILITY_OUT": str(inputs)}
        t = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *paths]
        rc = subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode  # failures are reported, not raised
        suites: dict[str, Any] = {"rc": rc, "wall_s": round(time.monotonic() - t, 1), "tests": []}
        for case in ET.parse(xml).getroot().iter("testcase"):
            failed = case.find("failure") is not None or case.find("error") is not None
            skipped = case.find("skipped") is not None
            suites["tests"].append(
                {
                    "name": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}",
                    "time_s": round(float(case.get("time", 0)), 2),
                    "result": "failed" if failed else "skipped" if skipped else "passed",
                }
            )
        outcomes = json.loads(inputs.read_text()) if inputs.exists() else {}
    # hostile_<property>_examples / _outcomes (test_hostile_input.py), fault_* (test_faults.py)
    tried: dict[str, dict[str, Any]] = {}
    for key, value in outcomes.items():
        if key.startswith("hostile_") and key.endswith("_outcomes"):
            prop = key[len("hostile_") : -len("_outcomes")]
            tried[prop] = {"examples": outcomes.get(f"hostile_{prop}_examples", sum(value.values())), "outcomes": value}
    suites["inputs_tried"] = tried
    suites["faults"] = {k: v for k, v in outcomes.items() if k.startswith("fault_")}
    return suites


def markdown(doc: dict[str, Any]) -> str:
    load, cfg = doc["load"], doc["load"]["config"]
    v = load["verdicts"]
    lines = [
        "# polykv reliability report",
        "",
        f"Machine: {doc['machine']}. Model: default (SmolLM2-135M-Instruct Q4_1). Date: {doc['date']}.",
        "",
        f"## Load: {cfg['n_agents']} agents in {cfg['rounds']} rounds, {cfg['n_slots']} slots, "
        f"{load['pool_cells']}-token reserved pool",
        "",
        f"The base is the sample design document cut to the pool; each agent asks its own question about it "
        f"(polykv_py.data.questions), {cfg['n_predict']} greedy tokens each, at most {cfg['n_slots']} requests "
        f"in flight. Reference: the pristine server answering each request alone, unshared, from its own cache "
        f"after the same priming request ({load['reference_s']} s for all agents; "
        f"{len(load['reference_split'])} did not split at P). "
        f"Peak server RSS {load['server_rss_mb']} MB. Verdict: **{'PASS' if load['ok'] else 'FAIL'}**.",
        "",
        f"Against the reference, all rounds: {v['identical']} identical, {v['near_tie']} near-tie, "
        f"{v['different']} different; largest log-prob drift {v['max_drift']}.",
        "",
        "| round | wall s | errors | statuses | identical | near-tie | different | max log-prob drift "
        "| KV cells after erase | pool cells | leak |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in load["rounds"]:
        st = ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items()))
        lines.append(
            f"| {r['round']} | {r['wall_s']} | {len(r['errors'])} | {st} | {r['identical']} | "
            f"{r['near_tie']} | {len(r['different'])} | {r['max_drift']} | {r['kv_cells_after_erase']} | "
            f"{r['kv_cells_pool']} | {r['leak']} |"
        )
    lines += [
        "",
        "near-tie: the answer left the reference's path at a token whose two best candidates were "
        f"within {LAYOUT.tie} log-prob in both runs, after a prefix that agreed within {LAYOUT.drift} "
        "(src/polykv_py/harness/compare.py: concurrent requests sit in other KV cells and CPU attention rounds "
        "by cell order).",
        "",
    ]
    suites = doc.get("suites")
    if suites:
        n = {k: sum(t["result"] == k for t in suites["tests"]) for k in ("passed", "failed", "skipped")}
        lines += [
            f"## Faults, hostile input, pool pinning ({suites['wall_s']} s)",
            "",
            f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped.",
            "",
            "| test | result | s |",
            "|---|---|---:|",
        ]
        lines += [f"| {t['name']} | {t['result']} | {t['time_s']} |" for t in suites["tests"]]
        if suites["inputs_tried"]:
            lines += [
                "",
                "Hostile inputs tried (hypothesis examples; no 5xx, no crash, no share over "
                "non-matching tokens in any):",
                "",
                "| property | examples | outcomes |",
                "|---|---:|---|",
            ]
            for prop, d in sorted(suites["inputs_tried"].items()):
                oc = ", ".join(f"{k} {v}" for k, v in sorted(d["outcomes"].items()))
                lines.append(f"| {prop} | {d['examples']} | {oc} |")
        if suites.get("faults"):
            lines += ["", "Fault outcomes (tests/integration/test_faults.py):", "", "| key | value |", "|---|---|"]
            lines += [f"| {k} | {str(v).replace('|', '/')[:160]} |" for k, v in sorted(suites["faults"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.reliability", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--pool-tokens", type=int, default=2048)
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--n-predict", type=int, default=16)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--skip-suites", action="store_true", help="only the load run")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    cfg = LoadConfig(
        n_slots=args.slots,
        pool_tokens=args.pool_tokens,
        n_agents=args.agents,
        rounds=args.rounds,
        n_predict=args.n_predict,
        threads=args.threads,
    )
    report: LoadReport = run_load(cfg, progress=True)
    doc: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}",
        "load": report.to_json(),
    }
    if not args.skip_suites:
        doc["suites"] = run_suites(SUITES)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reliability.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "reliability.md").write_text(markdown(doc))
    print(markdown(doc))
    ok = report.ok and (args.skip_suites or doc["suites"]["rc"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

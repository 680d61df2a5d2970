"""The provenance soak: the randomized oracle run long, and the TTFT timing across salts (issue 34).

    python -m bench.oracle                        # seeds 1..4, 60 rounds each, 24 timing trials
    python -m bench.oracle --seeds 7 --rounds 20  # a quick look

The servers are ``polykv serve``'s recipe (one reserved pool, 4 agent slots, --share-any, --shared-decode, a
LoRA adapter loaded) and the reference server with the same adapter (tests/integration/test_provenance_oracle.py
is the CI-sized run). Writes bench/results/oracle/oracle.json and oracle.md: per seed the requests, shares,
own-cache takes, answers compared and their verdicts, findings (a run passes with none and no ``different``
answer), and the AUC of hit-vs-miss time to first token across salts and within one.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from polykv_py.harness.lora import write_adapter
from polykv_py.harness.oracle import run_oracle
from polykv_py.harness.salt_timing import measure_salt_timing
from polykv_py.presets import reference_server, serve_server

from . import RESULTS
from .machine import load_avg, machine

log = logging.getLogger(__name__)

AGENTS = (1, 2, 3, 4)
POOLS = (0,)


def run(seeds: list[int], rounds: int, trials: int, work: Path) -> dict[str, Any]:
    adapter = write_adapter(work / "kv-lora.gguf")
    lora = ["--lora", str(adapter), "--lora-init-without-apply"]
    save = work / "pools"
    save.mkdir(mode=0o700)
    doc: dict[str, Any] = {"machine": machine(), "seeds": [], "rounds": rounds}
    for seed in seeds:
        srv = serve_server(len(POOLS), agent_slots=len(AGENTS), ctx=8192, threads=2, slot_save_path=f"{save}/",
                           log_dir=work, name=f"oracle-{seed}", extra_args=lora)  # fmt: skip
        ref = reference_server(n_slots=1, ctx=8192, threads=2, log_dir=work, extra_args=lora)
        with srv.start(), ref.start():
            report = run_oracle(srv.url, ref.url, seed=seed, rounds=rounds, agent_slots=AGENTS, pools=POOLS, lora=True)
        log.info("seed %d: %s", seed, report.summary())
        doc["seeds"].append(report.to_json() | {"summary": report.summary()})
    srv = serve_server(1, agent_slots=3, ctx=8192, threads=2, log_dir=work, name="salt-timing")
    with srv.start():
        timing = measure_salt_timing(srv.url, trials=trials, salt_a="tenant-a-7f3e", salt_b="tenant-b-1d0a")
    doc["salt_timing"] = timing.to_json()
    doc["machine"]["load_avg_end"] = load_avg()
    return doc


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        "# Provenance soak (python -m bench.oracle)",
        "",
        f"{m['cpu']}, {m['logical_cpus']} logical CPUs, load average {m['load_avg_start']} at start, "
        f"{m['load_avg_end']} at the end; {doc['rounds']} rounds per seed.",
        "",
        "| seed | requests | shares | own-cache takes | compared | identical | near tie | different | findings | "
        "unexplained | wall s |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in doc["seeds"]:
        v = r["verdicts"]
        lines.append(
            f"| {r['seed']} | {r['requests']} | {r['shares']} | {r['own_cache_takes']} | {r['compared']} | "
            f"{v.get('identical', 0)} | {v.get('near_tie', 0)} | {v.get('different', 0)} | {len(r['findings'])} | "
            f"{len(r['unexplained'])} | {r['wall_s']:.0f} |"
        )
    t = doc["salt_timing"]
    lines += [
        "",
        f"TTFT, hit vs miss ({len(t['hit'])} paired trials): AUC across salts **{t['auc_across_salts']:.2f}** "
        f"(0.5: TTFT says nothing), within one salt {t['auc_within_salt']:.2f} (the control). Median TTFT s: "
        + ", ".join(f"{k} {sorted(t[k])[len(t[k]) // 2]:.3f}" for k in ("hit", "miss", "same_salt_hit")),
        "",
    ]
    for r in doc["seeds"]:
        for f in r["findings"]:
            lines.append(f"- seed {r['seed']}: {f['kind']}: {f['detail']}")
        for d in r["different"]:
            lines.append(f"- seed {r['seed']}: different: {d}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--trials", type=int, default=24, help="paired TTFT trials across salts")
    ap.add_argument("--out", type=Path, default=RESULTS / "oracle")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="polykv-oracle-") as tmp:
        doc = run(args.seeds, args.rounds, args.trials, Path(tmp))
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "oracle.json").write_text(json.dumps(doc, indent=1))
    (args.out / "oracle.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0 if all(r["ok"] for r in doc["seeds"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

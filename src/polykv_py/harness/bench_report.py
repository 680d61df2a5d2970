"""Markdown and PNG rendering of a fan-out benchmark document (see :mod:`polykv_py.harness.benchmark`)."""

from __future__ import annotations

import logging
import platform
from pathlib import Path
from typing import Any

from .report import fmt, ratio, table

log = logging.getLogger(__name__)

Json = dict[str, Any]

LABELS = {
    "reference": "reference (no sharing)",
    "reference_best": "reference + host cache/similarity",
    "reference_matched": "reference, same KV budget",
    "patched": "patched (pool sharing)",
    "engine": "in-process engine",
}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _round(cell: Json, r: int) -> Json | None:
    rounds = cell.get("rounds") or []
    return rounds[r] if len(rounds) > r else None


def _index(doc: Json) -> dict[tuple[str, int, int], Json]:
    return {(c["system"], c["n"], c["p"]): c for c in doc.get("cells", [])}


def _targets(cfg: Json, n: int, p_actual: int) -> tuple[int, int]:
    s, g = cfg["suffix"], cfg["gen"]
    return p_actual + n * s, p_actual + n * (s + g)


def round_table(doc: Json, r: int) -> str:
    """One row per (P, N, system) for round ``r``."""
    idx = _index(doc)
    cfg = doc["config"]
    rows = []
    for p in sorted(cfg["ps"]):
        for n in sorted(cfg["ns"]):
            ref = idx.get(("reference", n, p))
            best = idx.get(("reference_best", n, p))
            same = idx.get(("reference_matched", n, p))
            ref_r = _round(ref, r) if ref else None
            best_r = _round(best, r) if best else None
            same_r = _round(same, r) if same else None
            for system in cfg["systems"]:
                cell = idx.get((system, n, p))
                if cell is None:
                    continue
                rd = _round(cell, r)
                if rd is None:
                    rows.append(
                        [
                            p,
                            n,
                            LABELS.get(system, system),
                            None,
                            None,
                            None,
                            None,
                            None,
                            None,
                            None,
                            None,
                            f"error: {str(cell.get('error', ''))[:60]}",
                        ]
                    )
                    continue
                tok_target, kv_bound = _targets(cfg, n, rd.get("prefix_tokens") or p)
                note = ", ".join(f"{k} {v}" for k, v in sorted((rd.get("statuses") or {}).items()))
                if system == "patched" and r == 0:
                    note += f"; target tokens {tok_target:,}, KV bound {kv_bound:,}+c"
                if system == "reference_matched" and r == 0:
                    note += f"; -c {cell.get('ctx', 0):,}, {cell.get('slots')} slot(s)"
                if rd.get("n_errors"):
                    note += f"; {rd['n_errors']} errors"
                rows.append(
                    [
                        p,
                        n,
                        LABELS.get(system, system),
                        rd["wall_s"],
                        ratio(ref_r["wall_s"], rd["wall_s"]) if ref_r else None,
                        ratio(best_r["wall_s"], rd["wall_s"]) if best_r else None,
                        ratio(same_r["wall_s"], rd["wall_s"]) if same_r else None,
                        rd.get("ttft_mean_s"),
                        rd.get("prompt_tokens_processed"),
                        rd.get("kv_cells_peak"),
                        rd.get("rss_peak_mib"),
                        note,
                    ]
                )
    headers = [
        "P",
        "N",
        "system",
        "wall s",
        "x vs ref",
        "x vs ref best",
        "x vs same KV",
        "TTFT mean s",
        "prompt tok",
        "KV peak",
        "RSS MiB",
        "share statuses / notes",
    ]
    return table(headers, rows, markdown=True)


def capacity_table(doc: Json) -> str:
    rows = []
    for c in doc.get("capacity", []):
        steps = "; ".join(
            f"N={s['n']}: {'fits' if s.get('fits') else 'fails' if s.get('fits') is False else s.get('note', '?')}"
            + (
                f" (KV peak {s['kv_cells_peak']:,}, {s.get('kv_evictions', 0)} eviction lines)"
                if s.get("kv_cells_peak") is not None
                else ""
            )
            for s in c.get("steps", [])
        )
        rows.append(
            [
                LABELS.get(c["system"], c["system"]),
                c["ctx"],
                c["p"],
                c.get("predicted"),
                c.get("largest_fitting"),
                c.get("smallest_failing"),
                steps or c.get("error", "-"),
            ]
        )
    return table(
        ["system", "-c", "P", "predicted N", "largest N that fit", "smallest N that failed", "steps"],
        rows,
        markdown=True,
    )


def headline(doc: Json) -> list[str]:
    """The targets of the issue, checked against what was measured."""
    idx = _index(doc)
    cfg = doc["config"]
    lines = []
    n_t = 8 if 8 in cfg["ns"] else max(cfg["ns"])
    p_t = min(cfg["ps"], key=lambda x: abs(x - 2048))
    pat, ref, best, same = (
        idx.get((s, n_t, p_t)) for s in ("patched", "reference", "reference_best", "reference_matched")
    )
    if pat and _round(pat, 0):
        pr = _round(pat, 0)
        assert pr is not None
        tok_target, kv_bound = _targets(cfg, n_t, pr.get("prefix_tokens") or p_t)
        lines.append(
            f"- N={n_t}, P={p_t}: patched prompt tokens processed {fmt(pr['prompt_tokens_processed'])} "
            f"(target P+N*S = {tok_target:,}); peak KV cells {fmt(pr.get('kv_cells_peak'))} "
            f"(bound P+N*(S+G) = {kv_bound:,} + small constant)"
        )
        for other, name, want in ((ref, "reference", 6), (best, "reference with its best built-in option", 6)):
            orr = _round(other, 0) if other else None
            if orr:
                x = ratio(orr["wall_s"], pr["wall_s"])
                lines.append(
                    f"- round 1 (priming included) vs {name}: {fmt(x)}x faster (target >= {want}x); "
                    f"{fmt(ratio(orr['prompt_tokens_processed'], pr['prompt_tokens_processed']))}x fewer prompt "
                    f"tokens computed, {fmt(ratio(orr.get('kv_cells_peak'), pr.get('kv_cells_peak')))}x fewer "
                    "peak KV cells (load-independent)"
                )
        sr = _round(same, 0) if same else None
        if same and sr:
            lines.append(
                f"- round 1 vs the reference held to the same KV budget (-c {same.get('ctx', 0):,}, "
                f"{same.get('slots')} slot(s), agents queued): {fmt(ratio(sr['wall_s'], pr['wall_s']))}x faster, "
                f"mean TTFT {fmt(sr.get('ttft_mean_s'))} s vs {fmt(pr.get('ttft_mean_s'))} s (no target)"
            )
        pr2 = _round(pat, 1)
        for other, name in (
            (ref, "reference"),
            (best, "reference with its best built-in option"),
            (same, "reference held to the same KV budget"),
        ):
            or2 = _round(other, 1) if other else None
            if pr2 and or2:
                lines.append(
                    f"- round 2 (a new question per agent) vs the {name}'s round 2: "
                    f"{fmt(ratio(or2['wall_s'], pr2['wall_s']))}x; prompt tokens "
                    f"{fmt(or2['prompt_tokens_processed'])} vs {fmt(pr2['prompt_tokens_processed'])} "
                    "(target >= 15x)"
                )
    for c in doc.get("capacity", []):
        lines.append(
            f"- capacity at -c {c['ctx']}, P={c['p']}: {LABELS.get(c['system'], c['system'])} "
            f"largest N that fit = {fmt(c.get('largest_fitting'))} (tried {c.get('candidates')}, "
            f"predicted {c.get('predicted')}; targets: patched >= 100, reference about 3)"
        )
    return lines


def markdown(doc: Json) -> str:
    """The benchmark report."""
    cfg = doc.get("config", {})
    m = doc.get("machine", {})
    quick = " (--quick)" if cfg.get("quick") else ""
    out = [
        "# polykv fan-out benchmark",
        "",
        (
            f"Machine: {m.get('cpu', '?')}, {m.get('logical_cpus', '?')} logical CPUs, {m.get('memory_gib', '?')} GiB; "
            f"{m.get('threads_per_server', '?')} threads per server; load average at start "
            f"{m.get('load_avg_start')}, at end {m.get('load_avg_end', '-')}."
        ),
        (
            f"Model: `{Path(str(doc.get('model', '?'))).name}`. Started {doc.get('started', '?')}, "
            f"finished {doc.get('finished', '(running)')}."
        ),
        (
            f"Grid: N in {sorted(cfg.get('ns', []))}, P in {sorted(cfg.get('ps', []))}, {cfg.get('suffix')}-token "
            f"suffixes, {cfg.get('gen')} generated tokens (greedy, ignore_eos), {cfg.get('rounds')} rounds{quick}."
        ),
        (
            "Servers: `-kvu -np N+1 -c (N+1)*(P+S+G+16)`, one fresh server per cell; reference = pristine server with "
            "the patched server's flags (`--no-clear-idle --cache-ram 0`); reference best = `--cache-ram 8192 "
            "--cache-idle-slots --slot-prompt-similarity 0.1` and the base sent once first; patched = pool slot "
            "primed, agents share it; reference same KV budget = pristine server at `-c` = the sharing bound "
            "P+N*(S+G+16)+64 (rounded up to 256) with as many slots as whole prompts fit, agents queued that many at "
            "a time. Round 2 asks every agent a new question (same base, new suffix)."
        ),
        (
            f"KV cells: {doc.get('kv_cells_method', '-')}. Wall time and TTFT are measured from the start of the "
            "fan-out, priming included. 'x vs ref' = reference wall time / this wall time."
        ),
        "",
    ]
    for note in doc.get("notes", []):
        out.append(f"> note: {note}")
    if doc.get("notes"):
        out.append("")
    lines = headline(doc)
    if lines:
        out += ["## Targets", "", *lines, ""]
    out += ["## Round 1 (priming included)", "", round_table(doc, 0), ""]
    if cfg.get("rounds", 1) > 1:
        out += ["## Round 2 (the same agents, a new question each, same pool/server)", "", round_table(doc, 1), ""]
    if doc.get("capacity"):
        out += ["## Capacity (no eviction, no error)", "", capacity_table(doc), ""]
    return "\n".join(out)


def plot(doc: Json, path: Path) -> Path | None:
    """Wall time and peak KV cells against N, per system and P. None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cfg = doc["config"]
    idx = _index(doc)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels: list[tuple[Any, str, int, str]] = [
        (axes[0], "wall_s", 0, "round 1 wall time (s)"),
        (axes[1], "wall_s", 1, "round 2 wall time (s)"),
        (axes[2], "kv_cells_peak", 0, "peak KV cells"),
    ]
    styles = ["-", "--", ":"]
    for ax, key, r, title in panels:
        for si, system in enumerate(cfg["systems"]):
            for pi, p in enumerate(cfg["ps"]):
                xs, ys = [], []
                for n in sorted(cfg["ns"]):
                    cell = idx.get((system, n, p))
                    rd = _round(cell, r) if cell else None
                    if rd and rd.get(key) is not None:
                        xs.append(n)
                        ys.append(rd[key])
                if xs:
                    ax.plot(
                        xs,
                        ys,
                        styles[pi % len(styles)],
                        marker="o",
                        color=f"C{si}",
                        label=f"{LABELS.get(system, system)}, P={p}",
                    )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("agents N")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    m = doc.get("machine", {})
    fig.suptitle(
        f"polykv fan-out, {Path(str(doc.get('model', ''))).name}, {m.get('cpu', '')} "
        f"({m.get('threads_per_server')} threads)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

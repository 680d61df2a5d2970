"""Markdown and PNG rendering of a fan-out benchmark document (see :mod:`bench.fanout`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polykv_py.harness.report import fmt, ratio, table
from polykv_py.jsontypes import Json

from .systems import STOCK, SYSTEMS, best_stock

LABELS = {**{name: spec.label for name, spec in SYSTEMS.items()}, "engine": "in-process engine"}


def _round(cell: Json, r: int) -> Json | None:
    rounds = cell.get("rounds") or []
    return rounds[r] if len(rounds) > r else None


def _index(doc: Json) -> dict[tuple[str, int, int], Json]:
    return {(c["system"], c["n"], c["p"]): c for c in doc.get("cells", [])}


def _targets(cfg: Json, n: int, p_actual: int) -> tuple[int, int]:
    s, g = cfg["suffix"], cfg["gen"]
    return p_actual + n * s, p_actual + n * (s + g)


def _best_stock(idx: dict[tuple[str, int, int], Json], n: int, p: int, r: int) -> tuple[str, float] | None:
    walls: dict[str, float | None] = {}
    for name in STOCK:
        cell = idx.get((name, n, p))
        rd = _round(cell, r) if cell else None
        walls[name] = rd["wall_s"] if rd else None
    return best_stock(walls)


def round_table(doc: Json, r: int) -> str:
    """One row per (P, N, system) for round ``r``; 'x vs best stock' = the fastest stock wall time / this one."""
    idx = _index(doc)
    cfg = doc["config"]
    rows: list[list[Any]] = []
    for p in sorted(cfg["ps"]):
        for n in sorted(cfg["ns"]):
            best = _best_stock(idx, n, p, r)
            for system in cfg["systems"]:
                cell = idx.get((system, n, p))
                if cell is None:
                    continue
                rd = _round(cell, r)
                if rd is None:
                    rows.append(
                        [p, n, LABELS.get(system, system), *[None] * 7, f"error: {str(cell.get('error', ''))[:60]}"]
                    )
                    continue
                note = ", ".join(f"{k} {v}" for k, v in sorted((rd.get("statuses") or {}).items()))
                if system == "patched" and r == 0:
                    tok_target, kv_bound = _targets(cfg, n, rd.get("prefix_tokens") or p)
                    note += f"; target tokens {tok_target:,}, KV bound {kv_bound:,}+c"
                if best and system == "patched":
                    note += f"; best stock: {best[0]}"
                if system in SYSTEMS and SYSTEMS[system].budget == "shared" and r == 0:
                    note += f"; -c {cell.get('ctx', 0):,}, {cell.get('slots')} slot(s)"
                if rd.get("n_errors"):
                    note += f"; {rd['n_errors']} errors"
                rows.append(
                    [
                        p,
                        n,
                        LABELS.get(system, system),
                        rd["wall_s"],
                        ratio(best[1], rd["wall_s"]) if best else None,
                        rd.get("ttft_mean_s"),
                        rd.get("ttft_max_s"),
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
        "x vs best stock",
        "TTFT mean s",
        "TTFT max s",
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
    """What sharing buys in the target cell (N=8, P about 2,048) against each stock system, and capacity."""
    idx = _index(doc)
    cfg = doc["config"]
    lines = []
    n_t = 8 if 8 in cfg["ns"] else max(cfg["ns"])
    p_t = min(cfg["ps"], key=lambda x: abs(x - 2048))
    pat = idx.get(("patched", n_t, p_t))
    pr = _round(pat, 0) if pat else None
    if pr:
        tok_target, kv_bound = _targets(cfg, n_t, pr.get("prefix_tokens") or p_t)
        lines.append(
            f"- N={n_t}, P={p_t}: patched prompt tokens processed {fmt(pr['prompt_tokens_processed'])} "
            f"(target P+N*S = {tok_target:,}); peak KV cells {fmt(pr.get('kv_cells_peak'))} "
            f"(bound P+N*(S+G) = {kv_bound:,} + small constant)"
        )
        for r, label in ((0, "round 1 (priming included)"), (1, "round 2 (a new question each)")):
            pr_r = _round(pat, r) if pat else None
            best = _best_stock(idx, n_t, p_t, r)
            if pr_r and best:
                lines.append(
                    f"- {label}: {fmt(ratio(best[1], pr_r['wall_s']))}x faster than the best stock "
                    f"system in this cell ({LABELS[best[0]]}, {best[1]:.1f} s vs {pr_r['wall_s']:.1f} s)"
                )
        for name in STOCK:
            cell = idx.get((name, n_t, p_t))
            sr = _round(cell, 0) if cell else None
            if sr:
                lines.append(
                    f"  - vs {LABELS[name]}: wall {fmt(ratio(sr['wall_s'], pr['wall_s']))}x, mean TTFT "
                    f"{fmt(ratio(sr.get('ttft_mean_s'), pr.get('ttft_mean_s')))}x, prompt tokens computed "
                    f"{fmt(ratio(sr['prompt_tokens_processed'], pr['prompt_tokens_processed']))}x, peak KV cells "
                    f"{fmt(ratio(sr.get('kv_cells_peak'), pr.get('kv_cells_peak')))}x"
                )
    for c in doc.get("capacity", []):
        lines.append(
            f"- capacity at -c {c['ctx']}, P={c['p']}: {LABELS.get(c['system'], c['system'])} "
            f"largest N that fit = {fmt(c.get('largest_fitting'))}, smallest that failed = "
            f"{fmt(c.get('smallest_failing'))} (tried {c.get('candidates')}, predicted {c.get('predicted')})"
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
            "Servers, one fresh server per cell: "
            + "; ".join(
                f"`{name}` = {spec.label} (`{' '.join(spec.flags) or 'no extra flags'}`)"
                for name, spec in SYSTEMS.items()
            )
            + ". Budgets: N copies = `-np N+1 -c (N+1)*(P+S+G+16)`; the sharing budget = `-c` P+N*(S+G+16)+64 "
            "(rounded up to 256), with as many stock slots as whole prompts fit (agents queued). Round 2 asks every "
            "agent a new question (same base, new suffix)."
        ),
        (
            f"KV cells: {doc.get('kv_cells_method', '-')}. Wall time and TTFT are measured from the start of the "
            "fan-out, priming included. 'x vs best stock' = the fastest stock system's wall time in that cell / "
            "this one."
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
    """Three panels against N: patched's speed-up over the best stock system, round-1 wall time per
    system, and peak KV cells per system (log scales). None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return None
    cfg = doc["config"]
    idx = _index(doc)
    ns = sorted(cfg["ns"])
    styles = ["-", "--", ":"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for pi, p in enumerate(sorted(cfg["ps"])):
        xs, ys = [], []
        for n in ns:
            pat = idx.get(("patched", n, p))
            pr, best = (_round(pat, 0) if pat else None), _best_stock(idx, n, p, 0)
            if pr and best:
                xs.append(n)
                ys.append(best[1] / pr["wall_s"])
        if xs:
            axes[0].plot(xs, ys, styles[pi % 3], marker="o", color="C3")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_title("patched speed-up over the best stock system (round 1)")
    for ax, key, title in ((axes[1], "wall_s", "round 1 wall time (s)"), (axes[2], "kv_cells_peak", "peak KV cells")):
        for si, system in enumerate(cfg["systems"]):
            for pi, p in enumerate(sorted(cfg["ps"])):
                pts = [
                    (n, rd[key])
                    for n in ns
                    if (c := idx.get((system, n, p))) and (rd := _round(c, 0)) and rd.get(key) is not None
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), styles[pi % 3], marker="o", color=f"C{si}")
        ax.set_yscale("log")
        ax.set_title(title)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("agents N")
        ax.grid(True, alpha=0.3)
    systems = [
        Line2D([], [], color=f"C{si}", marker="o", label=LABELS.get(s, s)) for si, s in enumerate(cfg["systems"])
    ]
    ps = [
        Line2D([], [], color="black", ls=styles[pi % 3], label=f"P = {p:,}") for pi, p in enumerate(sorted(cfg["ps"]))
    ]
    axes[1].legend(handles=systems, fontsize=7)
    axes[0].legend(handles=ps, fontsize=8)
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

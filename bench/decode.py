"""Decode over a shared prefix: the per-token step with the shared-prefix attention off and on.

N agents share one pool of P tokens on the patched server (unified KV, reserved pool, every
agent ``hit``) and generate G greedy tokens each, all at once, so every decode step is one
batch of N rows over the same prefix cells. Each cell runs twice on fresh servers that differ
only in ``--shared-decode`` (patch 0076): ``patched`` (upstream's attention kernel) and
``shared_decode``. The step is the server's ``timings.predicted_per_token_ms`` (median over the
agents); the fan-out wall runs from sending the agents to the last answer (the pool is primed
before, the same way for both). Answers are compared token for token (greedy text).

The in-process engine links the same libggml: its cell runs N agents over the same prefix in
one process, with the switch off and then on (:mod:`polykv_py.llama.shared_decode`); its step
is the generation time over G.

Exactness (:mod:`bench.decode_exact`): at the largest P and N, for each G of ``--exact-gen``, the
agents go to each server as one multi-prompt request (same slots, cells and batches), and every
agent's greedy answer on is compared with its answer off, each flip with its log-prob gap. The
roofline (:mod:`bench.roofline`): the FP32 peak and the node warm and cold, at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from polykv_py.client import AsyncClient
from polykv_py.fanout import Agent, BasePrompt, Fanout

from . import RESULTS, decode_exact
from .common import round_up
from .fanout import engine_params
from .machine import load_avg, machine
from .multiturn import QUESTION_TOKENS, base_for, question_block
from .roofline import attention_shape, kernel_readings, path_rows
from .roofline import rows as roofline_rows
from .systems import SYSTEMS, UPSTREAM_DECODE, System, start_system_server

log = logging.getLogger(__name__)

#: The two systems of every cell, in the order they run.
#: off: the patched server with upstream's kernel; on: the benchmarks' ``patched`` (``--shared-decode``)
DECODE_SYSTEMS: dict[str, System] = {
    "patched": dataclasses.replace(UPSTREAM_DECODE, name="patched"),
    "shared_decode": dataclasses.replace(SYSTEMS["patched"], name="shared_decode"),
}


@dataclass(frozen=True)
class DecodeCell:
    """N agents over a P-token pool, G greedy tokens each."""

    p: int
    n: int
    gen: int
    kind: str = "step"  # "step": the step table; "fanout": the long-answer fan-out


def cells_for(cell: DecodeCell) -> int:
    """KV cells: the pool once plus every agent's question and answer, with a margin."""
    return round_up(cell.p + cell.n * (QUESTION_TOKENS + cell.gen + 16) + 64, 256)


async def _fanout(url: str, server: Any, base: str, cell: DecodeCell, timeout: float) -> dict[str, Any]:
    params = {"n_predict": cell.gen, "ignore_eos": True, "temperature": 0.0}
    agents = [Agent(question_block(i, 0)[0], name=f"a{i}", mode="completion", params=params) for i in range(cell.n)]
    async with AsyncClient(url, server=server, timeout=timeout) as client:
        sc = Fanout(client, BasePrompt.from_text(base), share=True, concurrency=cell.n)
        await sc.prime()
        before = await client.props()
        res = await sc.run(agents, prime=False)
        props = await client.props()
    steps = [a.timings.get("predicted_per_token_ms") for a in res.agents]
    return {
        "step_ms": round(median(s for s in steps if s is not None), 2),
        "wall_s": round(res.wall_s, 3),
        "statuses": res.statuses,
        "n_errors": sum(1 for a in res.agents if a.error),
        "texts": [a.text for a in res.agents],
        "shared_decode": props.get("polykv_shared_decode"),
        "path_time": path_time(before.get("polykv_shared_decode"), props.get("polykv_shared_decode")),
    }


def path_time(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, int] | None:
    """The path's counters over the fan-out alone (the pool's priming excluded): its ops and the time and work
    counters of ``/props`` (``polykv_shared_decode.time``); None for a server without them."""
    if not before or not after or "time" not in after or "time" not in before:
        return None
    out = {k: after["time"][k] - before["time"][k] for k in after["time"]}
    out["ops"] = after["ops"] - before["ops"]
    return out


def run_cell(system: System, cell: DecodeCell, base: str, *, threads: int, model: str | None) -> dict[str, Any]:
    """One cell on a fresh server of ``system``."""
    server = start_system_server(
        system, cell.n + 1, cells_for(cell), model=model, threads=threads, name=f"decode-{system.name}"
    )
    try:
        out = asyncio.run(_fanout(server.url, server, base, cell, timeout=3600.0))
    finally:
        server.stop()
    return {"system": system.name, "p": cell.p, "n": cell.n, "gen": cell.gen, "kind": cell.kind, **out}


def exact_cells(
    p: int, n: int, gens: Sequence[int], base: str, *, threads: int, model: str | None
) -> list[dict[str, Any]]:
    """One fixed batch of N agents at the largest G on a fresh server per system, off against on over each G's
    first tokens (:mod:`bench.decode_exact`)."""
    cell = DecodeCell(p, n, max(gens), "exact")
    answers = {}
    for system in DECODE_SYSTEMS.values():
        server = start_system_server(
            system, cell.n + 1, cells_for(cell), model=model, threads=threads, name=f"decode-exact-{system.name}"
        )
        try:
            answers[system.name] = decode_exact.one_batch(server, base, cell.n, cell.gen)
        finally:
            server.stop()
    return [
        {"p": p, "n_agents": n, "gen": g,
         **decode_exact.summarize(answers["patched"], answers["shared_decode"], None if g == cell.gen else g)}
        for g in sorted(gens)
    ]  # fmt: skip


def engine_cell(cell: DecodeCell, base: str, *, threads: int, model: str | None) -> list[dict[str, Any]]:
    """The same cell in-process: one engine, the switch off then on (the prefix decoded once)."""
    from polykv_py.engine import SharedPrefixEngine
    from polykv_py.llama import Model, set_shared_decode, shared_decode_stats

    suffixes = [question_block(i, 0)[0] for i in range(cell.n)]
    out = []
    with Model(model) as mdl:
        p_tok = len(mdl.vocab.tokenize(base))
        params, gp = engine_params(cell.n, p_tok, QUESTION_TOKENS, cell.gen, threads, flash_attn="on")
        with SharedPrefixEngine(mdl, params) as eng:
            for name, on in (("engine", False), ("engine_shared_decode", True)):
                set_shared_decode(on)
                try:
                    ops0 = shared_decode_stats().ops
                    res = eng.run(base, suffixes, gp, share=True)
                    ops = shared_decode_stats().ops - ops0
                finally:
                    set_shared_decode(False)
                out.append(
                    {
                        "system": name, "p": cell.p, "n": cell.n, "gen": cell.gen, "kind": "engine",
                        "step_ms": round(1000 * res.timings["generate_s"] / cell.gen, 2),
                        "wall_s": round(res.timings["wall_s"], 3),
                        "texts": [a.text for a in res.agents],
                        "shared_decode": {"enabled": on, "ops": ops},
                    }
                )  # fmt: skip
    return out


def run_grid(
    ps: Sequence[int],
    ns: Sequence[int],
    *,
    gen: int | Sequence[int] = 48,
    fanout: tuple[int, int, int] | None = (4096, 16, 256),
    engine: tuple[int, int] | None = (4096, 16),
    exact: Sequence[int] | None = None,
    repeat: int = 3,
    threads: int = 2,
    model: str | None = None,
    out_dir: Path = RESULTS / "decode",
    say: Callable[[str], None] = log.info,
) -> dict[str, Any]:
    """Every (P, N, G) step cell in ``repeat`` rounds and the long-answer fan-out once, each system on a fresh server,
    off then on; the kernel's node rate and the FP32 peak at the start and the end (:mod:`bench.roofline`); the
    exactness of one fixed batch at the largest P and N, compared over each G of ``exact`` (default: every G;
    ``[]``: none)."""
    gens = [gen] if isinstance(gen, int) else list(gen)
    cells = [DecodeCell(p, n, g) for g in gens for p in ps for n in ns]
    if fanout:
        cells.append(DecodeCell(fanout[0], fanout[1], fanout[2], "fanout"))
    doc: dict[str, Any] = {
        "config": {
            "ps": list(ps),
            "ns": list(ns),
            "gen": gens[0],
            "gens": gens,
            "fanout": fanout,
            "engine": engine,
            "exact": list(gens if exact is None else exact),
            "repeat": repeat,
            "threads": threads,
        },
        "machine": machine(),
        "systems": {name: s.label for name, s in DECODE_SYSTEMS.items()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cells": [],
        "exact": [],
        "kernel": [kernel_readings(threads)],
    }
    bases: dict[int, str] = {}
    for cell in cells:
        if cell.p not in bases:
            bases[cell.p] = base_for(cell.p, model)
    # rounds: every step cell once per round (off and on alternate, a fresh server each), so the host's drift
    # over the run falls on every cell alike and the roofline can take its pools' difference round by round
    runs: dict[DecodeCell, dict[str, list[dict[str, Any]]]] = {c: {name: [] for name in DECODE_SYSTEMS} for c in cells}
    for r in range(repeat):
        for cell in cells:
            if cell.kind != "step" and r > 0:
                continue
            for system in DECODE_SYSTEMS.values():
                say(f"decode: round {r + 1}/{repeat}: {system.name} {cell.kind} P={cell.p} N={cell.n} G={cell.gen} ...")
                res = run_cell(system, cell, bases[cell.p], threads=threads, model=model)
                say(f"decode: {system.name}: step {res['step_ms']} ms, wall {res['wall_s']} s")
                runs[cell][system.name].append(res)
        doc["cells"] = [merged(rs) for by_system in runs.values() for rs in by_system.values() if rs]
        write(doc, out_dir)
    if engine:
        cell = DecodeCell(engine[0], engine[1], gens[0], "engine")
        if cell.p not in bases:
            bases[cell.p] = base_for(cell.p, model)
        say(f"decode: in-process engine P={cell.p} N={cell.n} G={cell.gen}, off then on ...")
        doc["cells"] += engine_cell(cell, bases[cell.p], threads=threads, model=model)
    if doc["config"]["exact"]:
        p, n, gs = max(ps), max(ns), doc["config"]["exact"]
        if p not in bases:
            bases[p] = base_for(p, model)
        say(f"decode: exactness P={p} N={n} G={max(gs)}: one fixed batch per system ...")
        doc["exact"] = exact_cells(p, n, gs, bases[p], threads=threads, model=model)
        for row in doc["exact"]:
            say(f"decode: exactness G={row['gen']}: {row['identical']} identical / {row['near_tie']} near tie / "
                f"{row['different']} different, max drift {row['max_drift']}")  # fmt: skip
        write(doc, out_dir)
    doc["kernel"].append(kernel_readings(threads))
    shape = attention_shape(model)
    doc["roofline"] = roofline_rows(doc, shape)
    doc["path_time"] = path_rows(doc, shape)
    doc["machine"]["load_avg_end"] = load_avg()
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write(doc, out_dir)
    return doc


def merged(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's runs of a cell as one cell: the first run's answers, the median step and wall, every run's."""
    first = dict(rs[0])
    first["step_ms_runs"] = [r["step_ms"] for r in rs]
    first["path_time_runs"] = [r.get("path_time") for r in rs]
    first["wall_s_runs"] = [r["wall_s"] for r in rs]
    first["step_ms"] = round(median(first["step_ms_runs"]), 2)
    first["wall_s"] = round(median(first["wall_s_runs"]), 3)
    return first


def pairs(doc: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(off, on) cells of the same (kind, P, N, G), in run order."""
    off_names, on_names = ("patched", "engine"), ("shared_decode", "engine_shared_decode")
    off = {(c["kind"], c["p"], c["n"], c["gen"]): c for c in doc["cells"] if c["system"] in off_names}
    out = []
    for c in doc["cells"]:
        key = (c["kind"], c["p"], c["n"], c["gen"])
        if c["system"] in on_names and key in off:
            out.append((off[key], c))
    return out


def same_answers(off: dict[str, Any], on: dict[str, Any]) -> int:
    """Agents whose greedy answer is the same text with the path off and on."""
    return sum(1 for a, b in zip(off["texts"], on["texts"], strict=True) if a == b)


#: The step table's columns.
STEP_COLUMNS = [
    "P",
    "N",
    "G",
    "off ms/step",
    "on ms/step",
    "on/off",
    "speedup",
    "on vs first G",
    "same answers",
    "differences",
]


def first_differences(off: dict[str, Any], on: dict[str, Any]) -> str:
    """Where the differing answers first differ, as character offsets (the texts are what the server returned)."""
    at = []
    for a, b in zip(off["texts"], on["texts"], strict=True):
        if a != b:
            at.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))))
    return ", ".join(f"char {i}" for i in at) or "none"


def roofline_markdown(doc: dict[str, Any]) -> list[str]:
    """The prefix attention's rate in the server and at the ggml level, against the FP32 peak of the same run."""
    from polykv_py.harness.report import table

    if not doc.get("roofline") and not doc.get("kernel") and not doc.get("path_time"):
        return []
    lines = ["## The prefix attention against the FP32 peak", ""]
    kernel = doc.get("kernel", [])
    if kernel:
        lines += [
            "`polykv-fattn-check --bench` at the start and the end of this run (one node: N = 16 over 4,096 shared "
            "cells, the default model's heads, f16 KV, the benchmark's threads): "
            + "; ".join(
                f"node {k['ms_on']} ms on = {k['gflops_on']} GFLOP/s ({k['on_of_peak']:.0%} of peak), "
                f"upstream's kernel {k['ms_off']} ms, FP32 FMA peak {k['fma_peak_gflops']} GFLOP/s"
                + (
                    f"; cold nodes of {' and '.join(f'{c:,}' for c in k['cold']['cells'])} cells "
                    f"{' / '.join(map(str, k['cold']['ms_on']))} ms on, {' / '.join(map(str, k['cold']['ms_off']))} ms "
                    "upstream"
                    if "cold" in k
                    else ""
                )
                for k in kernel
            )
            + ". Cold: 64 MiB read by each thread before every computation (untimed), as the server's weights pass "
            "through the caches between two attention nodes.",
            "",
        ]
    roof = doc.get("roofline") or []
    if roof:
        lines += [
            "In the server: the step at the larger P minus the step at the smaller P (same N and G; the median of "
            "the rounds' differences, each round running every cell once) is the extra "
            "cells' attention and whatever else grows with P; GFLOP counts the attention alone (per token, cell and "
            "query head a dot product and an axpy, every layer). Peak: the higher of the run's two readings. Cold "
            "nodes: what the same extra cells cost in one cold node per layer (the two cold nodes' difference per "
            "cell, median of the readings); the server's extra ms beyond it is what the step adds around the kernel.",
            "",
            table(
                ["system", "N", "G", "P", "extra ms/step", "cold nodes ms", "GFLOP", "GFLOP/s", "of FP32 peak"],
                [
                    [
                        r["system"],
                        r["n"],
                        r["gen"],
                        f"{r['p_lo']:,} -> {r['p_hi']:,}",
                        f"{r['extra_ms']} ({', '.join(map(str, r['extra_ms_runs']))})"
                        if r.get("extra_ms_runs")
                        else r["extra_ms"],
                        r.get("nodes_ms"),
                        r["gflop"],
                        r["gflops"],
                        None if r["of_peak"] is None else f"{r['of_peak']:.0%}",
                    ]
                    for r in roof
                ],
                markdown=True,
            ),
            "",
        ]
    paths = doc.get("path_time") or []
    if paths:
        path_table = table(
            ["N", "G", "P", "step ms", "path ms/step", "of step", "shared GFLOP/s", "of FP32 peak",
             "private GB/s", "of read bandwidth"],
            [
                [r["n"], r["gen"], f"{r['p']:,}", r["step_ms"], r["path_ms"], f"{r['path_of_step']:.0%}",
                 r["shared_gflops"], None if r["shared_of_peak"] is None else f"{r['shared_of_peak']:.0%}",
                 r["private_gbs"], None if r["private_of_read"] is None else f"{r['private_of_read']:.0%}"]
                for r in paths
            ],
            markdown=True,
        )  # fmt: skip
        lines += [
            "The path's own time in the server, counted by the kernel over each fan-out (the pool's priming left "
            "out; `/props` `polykv_shared_decode.time`): its nodes' wall time per step, and the threads' time in "
            "shared tiles (the prefix: mask, K/V conversion, both GEMMs, softmax) and in private cells (each "
            "agent's own), each as a rate of the two threads together: shared tiles' GFLOP/s against the FP32 peak, "
            "private pairs' K/V bytes against the read bandwidth from memory, both measured by the kernel check in "
            "this run (the higher of its readings). Medians of the runs.",
            "",
            path_table,
            "",
        ]
    return lines


def markdown(doc: dict[str, Any]) -> str:
    """The step table (off, on, on/off) and the fan-out line."""
    from polykv_py.harness.report import table

    m = doc["machine"]
    lines = [
        "# Decode over a shared prefix: --shared-decode off and on",
        "",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {doc['config']['threads']} threads per server, "
        f"load average at start {m['load_avg_start']}"
        + (f", at end {m['load_avg_end']}" if "load_avg_end" in m else "")
        + ".",
        "Every agent shares the pool (status hit); all N decode together. Step: the server's "
        "predicted_per_token_ms, median over the agents; each step cell ran "
        f"{doc['config'].get('repeat', 1)} times per system on fresh servers, off and on alternating, in rounds of "
        "every cell (median of the runs). Same answers: greedy texts equal with the path off and on (first run); "
        "a flip is a near tie, as with another cell layout (tests/integration/test_shared_decode.py).",
        "",
    ]
    rows: list[list[Any]] = []
    first_g: dict[tuple[int, int], float] = {}
    for off, on in sorted(pairs(doc), key=lambda c: (c[0]["p"], c[0]["n"], c[0]["gen"])):
        if off["kind"] != "step":
            continue
        base = first_g.setdefault((off["p"], off["n"]), on["step_ms"])
        rows.append(
            [
                f"{off['p']:,}",
                off["n"],
                off["gen"],
                off["step_ms"],
                on["step_ms"],
                f"{on['step_ms'] / off['step_ms']:.0%}",
                f"{off['step_ms'] / on['step_ms']:.2f}x",
                f"{on['step_ms'] / base - 1:+.1%}",
                f"{same_answers(off, on)}/{off['n']}",
                first_differences(off, on),
            ]
        )
    gens = doc["config"].get("gens", [doc["config"]["gen"]])
    lines += [
        f"## Decode step, {', '.join(map(str, gens))} greedy tokens per agent (G)",
        "",
        "on vs first G: the step with the path on against the same P and N at the smallest G (long answers add "
        "private cells). Differences: for each agent whose answer differs, the character of its text where it first "
        "differs. Off and on run on separate servers whose batches form at different moments, so answers also "
        "differ where the path is not used (N = 1 in earlier runs); the kernel's exactness is checked against "
        "double precision by polykv-fattn-check, and greedy answers in one fixed batch in the exactness section.",
        "",
        table(
            STEP_COLUMNS,
            rows,
            markdown=True,
        ),
        "",
    ]
    lines += decode_exact.markdown(doc.get("exact", []))
    lines += roofline_markdown(doc)
    for off, on in pairs(doc):
        if off["kind"] == "engine":
            lines += [
                f"## In-process engine: N={off['n']}, P={off['p']:,}, G={off['gen']} "
                "(one process, the switch off then on)",
                "",
                table(
                    ["off ms/step", "on ms/step", "on/off", "speedup", "same answers"],
                    [
                        [
                            off["step_ms"],
                            on["step_ms"],
                            f"{on['step_ms'] / off['step_ms']:.0%}",
                            f"{off['step_ms'] / on['step_ms']:.2f}x",
                            f"{same_answers(off, on)}/{off['n']}",
                        ]
                    ],
                    markdown=True,
                ),
                "",
            ]
        if off["kind"] == "fanout":
            lines += [
                f"## Long answers: N={off['n']}, P={off['p']:,}, G={off['gen']}",
                "",
                table(
                    ["system", "fan-out wall s", "ms/step", "same answers"],
                    [
                        ["patched (off)", off["wall_s"], off["step_ms"], None],
                        ["shared_decode (on)", on["wall_s"], on["step_ms"], f"{same_answers(off, on)}/{off['n']}"],
                        [
                            "speedup",
                            f"{off['wall_s'] / on['wall_s']:.2f}x",
                            f"{off['step_ms'] / on['step_ms']:.2f}x",
                            None,
                        ],
                    ],
                    markdown=True,
                ),
                "",
            ]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> Path | None:
    """Two panels against N: the speed-up of the step (on over off), and the step per system (log scale),
    one line style per P. None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return None
    g0 = doc["config"].get("gens", [doc["config"]["gen"]])[0]
    steps = [(off, on) for off, on in pairs(doc) if off["kind"] == "step" and off["gen"] == g0]
    ps = sorted({off["p"] for off, _ in steps})
    styles = ["-", "--", ":"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for pi, p in enumerate(ps):
        cell = sorted((off["n"], off, on) for off, on in steps if off["p"] == p)
        ns = [n for n, _, _ in cell]
        axes[0].plot(
            ns, [off["step_ms"] / on["step_ms"] for _, off, on in cell], styles[pi % 3], marker="o", color="C3"
        )
        axes[1].plot(ns, [off["step_ms"] for _, off, _ in cell], styles[pi % 3], marker="o", color="C0")
        axes[1].plot(ns, [on["step_ms"] for _, _, on in cell], styles[pi % 3], marker="o", color="C2")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_title("decode step speed-up, --shared-decode on over off")
    axes[1].set_yscale("log")
    axes[1].set_title("decode step (ms)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("agents N (all decoding together)")
        ax.grid(True, alpha=0.3)
    p_lines = [Line2D([], [], color="black", ls=styles[i % 3], label=f"P = {p:,}") for i, p in enumerate(ps)]
    axes[0].legend(handles=p_lines, fontsize=8)
    systems = [
        Line2D([], [], color="C0", marker="o", label="patched, off"),
        Line2D([], [], color="C2", marker="o", label="patched, --shared-decode"),
    ]
    axes[1].legend(handles=systems, fontsize=8)
    m = doc["machine"]
    fig.suptitle(f"polykv decode over a shared prefix, {m['cpu']} ({doc['config']['threads']} threads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(doc: dict[str, Any], out_dir: Path) -> None:
    """decode.json, decode.md and (with matplotlib) decode.png in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode.json").write_text(json.dumps(doc, indent=2))
    (out_dir / "decode.md").write_text(markdown(doc))
    if "finished" in doc:
        plot(doc, out_dir / "decode.png")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.decode``: the decode step table and the long-answer fan-out."""
    ap = argparse.ArgumentParser(
        prog="python -m bench.decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--p", type=int, nargs="+", default=[256, 4096], help="pool tokens (default 256 4096)")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 4, 16], help="agents (default 1 4 16)")
    ap.add_argument(
        "--gen", type=int, nargs="+", default=[48], help="greedy tokens per agent in the step table (default 48)"
    )
    ap.add_argument(
        "--fanout",
        type=int,
        nargs=3,
        metavar=("P", "N", "G"),
        default=[4096, 16, 256],
        help="the long-answer fan-out (default 4096 16 256)",
    )
    ap.add_argument("--no-fanout", action="store_true")
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process engine cell (N=16, P=4096)")
    ap.add_argument(
        "--exact-gen",
        type=int,
        nargs="*",
        help="G of the exactness pass (one fixed batch at the largest P and N; default: every --gen; none: skip)",
    )
    ap.add_argument(
        "--repeat", type=int, default=3, help="rounds: runs per system of each step cell, median (default 3)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", "-m")
    ap.add_argument("--out", type=Path, default=RESULTS / "decode")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    run_grid(
        args.p,
        args.n,
        gen=args.gen,
        fanout=None if args.no_fanout else tuple(args.fanout),
        engine=None if args.no_engine else (4096, 16),
        exact=args.exact_gen,
        repeat=args.repeat,
        threads=args.threads,
        model=args.model,
        out_dir=args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""The GPU device check: what a lent GPU machine needs, packed here, and the one command it runs there.

A machine lent through the ``device`` tool (one H100, 16 cores, nvcc, CMake, ninja, Python 3.12 with numpy,
httpx and psutil; no network; at most 64 MiB of working tree per call; 10 minutes per command, 15 minutes of
device time per session) cannot fetch the pinned sdist nor fit the 176 MB trees or the default model. So:

  pack  (here)   writes .device/ (git-ignored, carried): the patched and the pristine llama.cpp trees pruned to
                 what the two servers compile (tar.gz each), a tokenizer-only GGUF of the default model (its
                 vocabulary, merges and chat template) with its shape, and the gguf package (pure Python).
  run   (there)  builds both servers with the repository's CMakeLists.txt (POLYKV_SERVERS_ONLY: no patchtool, no
                 Python extension) for the backend (CUDA for sm_90 on 16 cores), writes a random-weight model at
                 the default model's shape with its tokenizer, runs the gate's checks with every layer offloaded
                 (-ngl 99), the backend checks (``polykv_py.harness.backend_checks``: zero-config answers vs the
                 stock server, pool files from the device to the CPU backend and back) and a fan-out of 16 and 32
                 agents over a ~1,000-token prefix against the stock server (ratios measured in one run), and
                 writes device_check.json and device_check.md under --out.

Rehearsed here (``tests/integration/test_device_check.py``, slow) with ``--backend vulkan`` on lavapipe in CI, or
``--backend cpu``, so that the first GPU run works the first time. On the device, from the repository root:

    python3 scripts/device_check.py run --out $OUT          # carry: [".device"]

Random weights are fine for what this checks: byte-identical default output (patched vs reference, same
kernels), exact shares, fallback misses, and timing (the work per token depends on the shape, not the values).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACK = ROOT / ".device"
log = logging.getLogger("device_check")

#: Top-level folders of the llama.cpp tree that the servers' build never reads (configure included).
SKIP_TOP = {"models", "docs", "tests", "examples", "benches", "conversion", "gguf-py", "media", ".github", ".devops"}
#: ggml backends carried (the rest of ggml/src/ggml-* is only read when its GGML_<NAME> option is on).
BACKENDS = ("ggml-cpu", "ggml-cuda", "ggml-vulkan", "ggml-blas")
#: The tokenizer's keys copied into tokenizer.gguf (and from there into the device's model).
TOKENIZER_PREFIX = "tokenizer."
#: The default model's shape keys (llama architecture) the device's model copies.
SHAPE_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
)


# --------------------------------------------------------------------------- pack (here)
def _kept(tree: Path) -> Iterator[Path]:
    """The files of ``tree`` the servers' build needs: everything but SKIP_TOP and the other ggml backends."""
    for top in sorted(tree.iterdir()):
        if top.name in SKIP_TOP:
            continue
        for path in [top] if top.is_file() else sorted(top.rglob("*")):
            rel = path.relative_to(tree)
            if _other_backend(rel):
                continue
            if path.is_file():
                yield path


def _other_backend(rel: Path) -> bool:
    """``rel`` lies in a ggml backend's source folder (ggml/src/ggml-<name>/) that is not carried."""
    parts = rel.parts
    return len(parts) > 3 and parts[:2] == ("ggml", "src") and parts[2].startswith("ggml-") and parts[2] not in BACKENDS


def pack_tree(tree: Path, dest: Path) -> int:
    """Writes the pruned ``tree`` as ``dest`` (tar.gz); returns its size in bytes."""
    with tarfile.open(dest, "w:gz", compresslevel=9) as tar:
        for path in _kept(tree):
            tar.add(path, arcname=str(path.relative_to(tree)), recursive=False)
    return dest.stat().st_size


def write_tokenizer(model: Path, dest: Path) -> dict[str, Any]:
    """A GGUF holding only ``model``'s tokenizer keys (no tensors); returns the model's shape (SHAPE_KEYS)."""
    import gguf

    reader = gguf.GGUFReader(model)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dest), arch)
    for name, field in reader.fields.items():
        if name.startswith(TOKENIZER_PREFIX):
            _copy_field(writer, name, field)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shape: dict[str, Any] = {"architecture": arch}
    for key in SHAPE_KEYS:
        if f"{arch}.{key}" in reader.fields:
            shape[key] = reader.fields[f"{arch}.{key}"].contents()
    shape["n_vocab"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    shape["tied_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
    return shape


def _copy_field(writer: Any, name: str, field: Any) -> None:
    import gguf

    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
    else:
        writer.add_key_value(name, field.contents(), kind)


def pack(dest: Path = PACK, model: Path | None = None) -> dict[str, Any]:
    """Writes everything the device needs into ``dest``; returns the manifest (also ``dest/manifest.json``)."""
    import gguf

    from polykv_py.models import resolve_model

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    manifest: dict[str, Any] = {"files": {}}
    trees = {"patched": ROOT / "vendor" / "llama.cpp", "pristine": ROOT / "vendor" / "llama.cpp-pristine"}
    for name, tree in trees.items():
        if not (tree / "include" / "llama.h").is_file():
            raise SystemExit(f"{tree} is missing: build once (pip install .) so the trees are unpacked and patched")
        manifest["files"][f"{name}.tar.gz"] = pack_tree(tree, dest / f"{name}.tar.gz")
    model_path = resolve_model(model)
    manifest["shape"] = write_tokenizer(model_path, dest / "tokenizer.gguf")
    manifest["tokenizer_from"] = model_path.name
    manifest["files"]["tokenizer.gguf"] = (dest / "tokenizer.gguf").stat().st_size
    shutil.copytree(Path(gguf.__file__).parent, dest / "site" / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    manifest["gguf_version"] = _dist_version("gguf")
    manifest["bytes"] = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- the model (there)
def write_model(pack_dir: Path, dest: Path, *, n_layer: int | None = None, seed: int = 1234) -> dict[str, Any]:
    """A random-weight F16 llama model at the packed shape (``n_layer``: fewer layers, for a rehearsal) with the
    packed tokenizer; returns the shape written."""
    sys.path.insert(0, str(pack_dir / "site"))  # the carried gguf package (the device has none)
    import gguf
    import numpy as np

    shape = dict(json.loads((pack_dir / "manifest.json").read_text())["shape"])
    if shape["architecture"] != "llama":
        raise SystemExit(f"the device model writer knows the llama architecture, not {shape['architecture']}")
    if n_layer:
        shape["block_count"] = n_layer
    n_embd, n_ff, n_vocab = shape["embedding_length"], shape["feed_forward_length"], shape["n_vocab"]
    n_head, n_head_kv = shape["attention.head_count"], shape["attention.head_count_kv"]
    head_dim = n_embd // n_head

    writer = gguf.GGUFWriter(str(dest), "llama")
    writer.add_name("polykv device check (random weights, the default model's shape and tokenizer)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key in SHAPE_KEYS:
        if key in shape:
            _ADD[key](writer, shape[key])
    reader = gguf.GGUFReader(pack_dir / "tokenizer.gguf")
    for name, field in reader.fields.items():
        if name.startswith(TOKENIZER_PREFIX):
            _copy_field(writer, name, field)

    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int) -> Any:  # scaled so activations keep unit size through the layers
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)

    writer.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, n_embd), dtype=np.float32).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    if not shape.get("tied_embeddings", True):
        writer.add_tensor("output.weight", weight(n_vocab, n_embd))
    for i in range(shape["block_count"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(n_head * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(n_embd, n_head * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return shape


_ADD: dict[str, Any] = {
    "context_length": lambda w, v: w.add_context_length(int(v)),
    "embedding_length": lambda w, v: w.add_embedding_length(int(v)),
    "block_count": lambda w, v: w.add_block_count(int(v)),
    "feed_forward_length": lambda w, v: w.add_feed_forward_length(int(v)),
    "attention.head_count": lambda w, v: w.add_head_count(int(v)),
    "attention.head_count_kv": lambda w, v: w.add_head_count_kv(int(v)),
    "attention.layer_norm_rms_epsilon": lambda w, v: w.add_layer_norm_rms_eps(float(v)),
    "rope.freq_base": lambda w, v: w.add_rope_freq_base(float(v)),
    "rope.dimension_count": lambda w, v: w.add_rope_dimension_count(int(v)),
}


# --------------------------------------------------------------------------- run (there)
def _run(cmd: Sequence[str | Path], log_path: Path, *, env: dict[str, str] | None = None, cwd: Path = ROOT) -> float:
    """Runs ``cmd`` with its output in ``log_path``; returns its wall time; raises with the log's tail on failure."""
    t0 = time.monotonic()
    with log_path.open("w") as out:
        argv = [str(c) for c in cmd]
        rc = subprocess.run(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise RuntimeError(f"{' '.join(str(c) for c in cmd)} exited {rc}; the end of {log_path}:\n{tail}")
    return time.monotonic() - t0


def build(cfg: RunConfig) -> dict[str, Any]:
    """Unpacks the trees into ``cfg.work`` and builds both servers for ``cfg.backend``; returns the build's record."""
    pack_dir, work, out, backend, jobs = cfg.pack_dir, cfg.work, cfg.out, cfg.backend, cfg.jobs
    trees = {}
    for name in ("patched", "pristine"):
        trees[name] = work / name
        shutil.rmtree(trees[name], ignore_errors=True)
        with tarfile.open(pack_dir / f"{name}.tar.gz") as tar:
            tar.extractall(trees[name], filter="data")
    defines = {
        "POLYKV_SERVERS_ONLY": "ON",
        "POLYKV_VENDOR_DIR": str(trees["patched"]),
        "POLYKV_PRISTINE_DIR": str(trees["pristine"]),
        "CMAKE_BUILD_TYPE": "Release",
        "CMAKE_INSTALL_PREFIX": str(work / "install"),
        "Python_EXECUTABLE": sys.executable,
    }
    if backend == "cuda":
        defines |= {"GGML_CUDA": "ON", "CMAKE_CUDA_ARCHITECTURES": cfg.cuda_arch}
    elif backend == "vulkan":
        defines["GGML_VULKAN"] = "ON"
        headers = _vulkan_include_dir()
        if headers:
            defines["Vulkan_INCLUDE_DIR"] = str(headers)
    build_dir = work / "build"
    configure = ["cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja", *(f"-D{k}={v}" for k, v in defines.items())]
    env = os.environ | {"CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    record: dict[str, Any] = {"backend": backend, "jobs": jobs, "defines": defines}
    record["configure_s"] = _run(configure, out / "configure.log", env=env)
    record["build_s"] = _run(["cmake", "--build", build_dir, "-j", str(jobs)], out / "build.log", env=env)
    _run(["cmake", "--install", build_dir], out / "install.log", env=env)
    native = work / "install" / "polykv_py" / "_native"
    record["patched_bin"] = str(native / "bin" / "llama-server")
    record["upstream_bin"] = str(native / "bin" / "llama-server-upstream")
    record["build_info"] = json.loads((native / "build_info.json").read_text())
    return record


def _vulkan_include_dir() -> Path | None:
    """Headers new enough for the pinned ggml-vulkan where the system's are not (``scripts/vulkan_headers.py``:
    Debian 13's, fetched with apt by package name); None where the system's will do."""
    import vulkan_headers  # scripts/, next to this file

    if (vulkan_headers.header_version(Path("/usr/include")) or 0) >= vulkan_headers.MIN_HEADER_VERSION:
        return None
    from polykv_py.cache import cache_dir

    return vulkan_headers.fetch_headers(cache_dir() / "vulkan")


def _py_env(pack_dir: Path, built: dict[str, Any]) -> dict[str, str]:
    """The environment of the gate and the benchmark: this checkout's Python, the servers just built."""
    paths = [str(ROOT / "src"), str(ROOT), str(pack_dir / "site"), os.environ.get("PYTHONPATH", "")]
    return os.environ | {
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "POLYKV_SERVER_BIN": built["patched_bin"],
        "POLYKV_UPSTREAM_SERVER_BIN": built["upstream_bin"],
        "PYTHONUNBUFFERED": "1",
    }


def fanout_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (N, P): each system's last-round wall time and the patched server's ratio to the fastest stock
    mode of the same run."""
    from bench.systems import best_stock

    cells: dict[tuple[int, int], dict[str, float]] = {}
    for c in doc["cells"]:
        walls = [r["wall_s"] for r in c.get("rounds", []) if r.get("wall_s") is not None and not r.get("n_errors")]
        if walls:
            cells.setdefault((c["n"], c["p"]), {})[c["system"]] = walls[-1]
    rows = []
    for (n, p), walls in sorted(cells.items()):
        best = best_stock(dict(walls))
        patched = walls.get("patched")
        rows.append(
            {
                "n": n,
                "p": p,
                "walls_s": walls,
                "best_stock": best[0] if best else None,
                "speedup_vs_best_stock": round(best[1] / patched, 2) if best and patched else None,
            }
        )
    return rows


@dataclass
class RunConfig:
    """What ``run`` does and where (the defaults are the device's)."""

    out: Path
    pack_dir: Path = PACK
    backend: str = "cuda"
    jobs: int = os.cpu_count() or 2
    cuda_arch: str = "90"
    agents: tuple[int, ...] = (16, 32)
    prefix: int = 1000
    gen: int = 64
    n_layer: int | None = None
    #: the gate's base prompt, sharers and tokens per answer (CI's gate sizes; smaller for a slow backend)
    base_tokens: int = 800
    sharers: int = 4
    n_predict: int = 12
    #: scratch space: the unpacked trees, the build, the model. An ignored folder of the checkout that is not
    #: carried, so a warm device keeps it between two calls (``stage``).
    work: Path = ROOT / ".device-work"
    #: "all"; or "build" (keeps the build in ``work``, recorded in build.json) then "check", two calls on a warm
    #: machine, where one would come close to the 10-minute limit of a command
    stage: str = "all"


def run(cfg: RunConfig) -> dict[str, Any]:
    """Builds, writes the model, runs the gate and the fan-out; writes device_check.json / .md under ``cfg.out``."""
    out, work = cfg.out, cfg.work
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    gpu = cfg.backend != "cpu"
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "gpu": _gpu_name()},
        "backend": cfg.backend,
        "stage": cfg.stage,
        "ok": False,
    }
    try:
        if cfg.stage in ("all", "build"):
            report["build"] = build(cfg)
            (work / "build.json").write_text(json.dumps(report["build"], indent=2) + "\n")
            report["ok"] = cfg.stage == "build"
        if cfg.stage in ("all", "check"):
            if "build" not in report:
                if not (work / "build.json").is_file():
                    raise RuntimeError(f"no build in {work}: run --stage build first (on the same, still warm machine)")
                report["build"] = json.loads((work / "build.json").read_text())
            check(cfg, report, gpu)
    except (RuntimeError, OSError, KeyError, ValueError) as exc:
        report["error"] = str(exc)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    (out / "device_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "device_check.md").write_text(render(report))
    return report


def check(cfg: RunConfig, report: dict[str, Any], gpu: bool) -> None:
    """The model, the gate, the backend checks and the fan-out on the servers of ``report["build"]``; fills
    ``report``."""
    out, work = cfg.out, cfg.work
    model = work / "model.gguf"
    report["model"] = {"shape": write_model(cfg.pack_dir, model, n_layer=cfg.n_layer), "bytes": model.stat().st_size}
    env = _py_env(cfg.pack_dir, report["build"])
    report["devices"] = _devices(report["build"]["patched_bin"], env)
    if gpu and not report["devices"]:
        raise RuntimeError(
            f"the {cfg.backend} build sees no device (llama-server --list-devices: none); for a Vulkan device that "
            "runs on the CPU (lavapipe: scripts/lavapipe.py) name it: GGML_VK_VISIBLE_DEVICES=0"
        )
    server_args = "-ngl 99" if gpu else ""
    threads = str(min(cfg.jobs, 8))
    gate_cmd = [
        sys.executable, "-m", "polykv_py.harness.gate", "--model", model, "--report", out / "gate.json",
        "--threads", threads, "--base-tokens", str(cfg.base_tokens), "--sharers", str(cfg.sharers),
        "--n-predict", str(cfg.n_predict),
        "--server-args", server_args, "--log-dir", work / "gate-logs", "--checks", ",".join(_gate_checks(gpu)),
    ]  # fmt: skip
    report["gate"] = _checks_step("gate", gate_cmd, out, env, report)
    backend_cmd = [
        sys.executable, "-m", "polykv_py.harness.backend_checks", "--model", model, "--threads", threads,
        "--server-args", server_args, "--log-dir", work / "backend-logs", "--report", out / "backend_checks.json",
    ]  # fmt: skip
    report["backend_checks"] = _checks_step("backend_checks", backend_cmd, out, env, report)
    fan_cmd = [
        sys.executable, "-m", "bench.fanout", "--model", model, "--n", *map(str, cfg.agents), "--p", str(cfg.prefix),
        "--gen", str(cfg.gen), "--rounds", "2", "--no-capacity", "--threads", threads,
        "--systems", "stock", "stock_queued", "patched", "--server-args", server_args, "--out", work / "fanout",
    ]  # fmt: skip
    report["fanout_s"] = _run(fan_cmd, out / "fanout.log", env=env)
    report["fanout"] = fanout_rows(json.loads((work / "fanout" / "fanout.json").read_text()))
    report["ok"] = (
        report["gate"]["ok"]
        and report["backend_checks"]["ok"]
        and all(r["speedup_vs_best_stock"] for r in report["fanout"])
    )


def _checks_step(name: str, cmd: list[Any], out: Path, env: dict[str, str], report: dict[str, Any]) -> dict[str, Any]:
    """Runs a command that writes ``out/<name>.json`` (``ok`` and ``checks``); its log is ``out/<name>.log``, its
    wall time ``report[<name>_s]``, a failure's tail ``report[<name>_error]``. Returns ok and each check's verdict."""
    try:
        report[f"{name}_s"] = _run(cmd, out / f"{name}.log", env=env)
    except RuntimeError as exc:
        report[f"{name}_error"] = str(exc)
    path = out / f"{name}.json"
    doc = json.loads(path.read_text()) if path.is_file() else {}
    return {
        "ok": bool(doc.get("ok")),
        "checks": {k: {"ok": v["ok"], "summary": v["summary"]} for k, v in doc.get("checks", {}).items()},
    }


def _devices(server_bin: str, env: dict[str, str]) -> list[str]:
    """The devices the server's backends see (``--list-devices``), e.g. ``Vulkan0: llvmpipe (...)``."""
    cmd = [server_bin, "--list-devices"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    lines = [line.strip() for line in res.stdout.splitlines()]
    if "Available devices:" not in lines:
        return []
    return [line for line in lines[lines.index("Available devices:") + 1 :] if line and line != "(none)"]


def _gate_checks(gpu: bool) -> list[str]:
    """The gate's checks for this backend: all of them, but --shared-decode's on a GPU (a CPU kernel: with the KV
    on the device the path never runs, and the server says so at start)."""
    from polykv_py.harness.gate import CHECKS

    return [c for c in CHECKS if not (gpu and c == "shared_decode")]


def _gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    res = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return res.stdout.strip() or None


def render(report: dict[str, Any]) -> str:
    """The report as a readable page: the build, the gate's checks, the fan-out's ratios."""
    m = report["machine"]
    lines = [
        f"# Device check: {report['backend']} ({'ok' if report['ok'] else 'FAILED'})",
        "",
        f"Machine: {m['gpu'] or 'no GPU'}; {m['cpus']} CPUs; {m['platform']}. Started {report['started']}, "
        f"{report['wall_s']} s in all.",
        "",
    ]
    if "build" in report:
        b = report["build"]
        built = f"configure {b['configure_s']:.0f} s, both servers {b['build_s']:.0f} s ({b['jobs']} jobs)"
        lines += [f"Build: {built}.", ""]
    if "devices" in report:
        lines += [f"Devices: {'; '.join(report['devices']) or 'none (the CPU only)'}.", ""]
    if "gate" in report:
        lines += ["| gate check | verdict | summary |", "|---|---|---|"]
        for name, c in report["gate"]["checks"].items():
            lines.append(f"| {name} | {'PASS' if c['ok'] else 'FAIL'} | {c['summary']} |")
        lines.append("")
    if report.get("fanout"):
        systems = sorted({s for r in report["fanout"] for s in r["walls_s"]})
        lines += [
            "Fan-out, round 2 (steady state): wall seconds per system; polykv's speedup over the fastest stock mode.",
            "",
            "| N | P | " + " | ".join(systems) + " | best stock | speedup |",
            "|--:|--:|" + "--:|" * len(systems) + "---|--:|",
        ]
        for r in report["fanout"]:
            walls = " | ".join(f"{r['walls_s'][s]:.2f}" if s in r["walls_s"] else "-" for s in systems)
            lines.append(f"| {r['n']} | {r['p']} | {walls} | {r['best_stock']} | {r['speedup_vs_best_stock']}x |")
        lines.append("")
    if "backend_checks" in report:
        lines += ["| backend check | verdict | summary |", "|---|---|---|"]
        for name, c in report["backend_checks"]["checks"].items():
            lines.append(f"| {name} | {'PASS' if c['ok'] else 'FAIL'} | {c['summary']} |")
        lines.append("")
    for key in ("gate_error", "backend_checks_error", "error"):
        if key in report:
            lines += [f"**{key}**:", "", "```", report[key][-3000:], "```", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="write .device/ here (the trees must be built once)")
    p.add_argument("--dir", type=Path, default=PACK)
    p.add_argument("--model", type=Path, help="the model whose tokenizer and shape are packed (default: the default)")
    r = sub.add_parser("run", help="build and check on this machine (the device, or here as a rehearsal)")
    r.add_argument("--dir", type=Path, default=PACK, help="what pack wrote")
    r.add_argument("--out", type=Path, required=True, help="where the report goes ($OUT on the device)")
    r.add_argument("--backend", choices=("cuda", "vulkan", "cpu"), default="cuda")
    r.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    r.add_argument("--cuda-arch", default="90", help="CMAKE_CUDA_ARCHITECTURES (default 90: H100/H200)")
    r.add_argument("--agents", type=int, nargs="+", default=[16, 32], help="fan-out sizes (default 16 32)")
    r.add_argument("--prefix", type=int, default=1000, help="the shared prefix's tokens (default 1000)")
    r.add_argument("--gen", type=int, default=64, help="tokens each agent generates (default 64)")
    r.add_argument("--layers", type=int, help="fewer layers than the default model's (a quick rehearsal)")
    r.add_argument("--base-tokens", type=int, default=RunConfig.base_tokens, help="the gate's base prompt")
    r.add_argument("--sharers", type=int, default=RunConfig.sharers, help="the gate's sharers")
    r.add_argument("--n-predict", type=int, default=RunConfig.n_predict, help="the gate's tokens per answer")
    r.add_argument("--work", type=Path, default=RunConfig.work, help="scratch folder (default .device-work/)")
    r.add_argument("--stage", choices=("all", "build", "check"), default="all", help="see RunConfig.stage")
    args = ap.parse_args(argv)
    # this checkout's polykv_py and bench/ (the device has no polykv installed; pack also reads the default model)
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
    logging.basicConfig(level=logging.INFO, format="device_check: %(message)s")
    if args.cmd == "pack":
        manifest = pack(args.dir.resolve(), args.model)
        log.info("wrote %s: %.1f MiB (%s)", args.dir, manifest["bytes"] / 2**20, ", ".join(manifest["files"]))
        return 0
    report = run(
        RunConfig(
            out=args.out.resolve(),
            pack_dir=args.dir.resolve(),
            backend=args.backend,
            jobs=args.jobs,
            cuda_arch=args.cuda_arch,
            agents=tuple(args.agents),
            prefix=args.prefix,
            gen=args.gen,
            n_layer=args.layers,
            base_tokens=args.base_tokens,
            sharers=args.sharers,
            n_predict=args.n_predict,
            work=args.work.resolve(),
            stage=args.stage,
        )
    )
    sys.stdout.write((args.out / "device_check.md").read_text())
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

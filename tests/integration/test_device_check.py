"""The GPU device check (``scripts/device_check.py``) rehearsed here, with the CPU or Vulkan build in place of CUDA.

A lent GPU machine has no network and takes at most 64 MiB of working tree per call, so a session that is lent
one must be able to pack, carry and run the check the first time. The rehearsal does exactly what the device
does: it packs the pruned trees, the tokenizer and the gguf package, unpacks them into a scratch folder, builds
both servers from them with the repository's CMakeLists.txt (``POLYKV_SERVERS_ONLY``), writes the random-weight
model (4 layers here, to keep the rehearsal short), and runs the gate's checks, the backend checks (zero-config
answers, pool files across backends) and a small fan-out; the report must say ok. The backend is
``POLYKV_REHEARSAL_BACKEND``: ``cpu`` by default; CI sets ``vulkan`` (``.ci/run`` installs lavapipe, a Vulkan
device that runs on the CPU), so every CI run builds the Vulkan variant of both servers and gates it with every
layer offloaded. The fast tests check the pruning, the model writer and the report's ratios without a build.
"""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import device_check  # scripts/, on sys.path through pytest's pythonpath option (pyproject.toml)
import gguf
import patchtool
import pytest

from polykv_py.models import default_model_path

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration

#: The backend the rehearsal builds and checks on (``cpu`` or ``vulkan``).
REHEARSAL_BACKEND = os.environ.get("POLYKV_REHEARSAL_BACKEND", "cpu")


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("device") / "pack"
    device_check.pack(dest)
    return dest


def test_pack_fits_one_device_call(packed: Path) -> None:
    """Everything packed plus the repository stays well inside the 64 MiB a call carries."""
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["bytes"] < 40 * 2**20, manifest["files"]
    assert (packed / "site" / "gguf" / "gguf_writer.py").is_file()
    assert manifest["shape"]["architecture"] == "llama"
    assert manifest["shape"]["n_vocab"] == len(
        gguf.GGUFReader(default_model_path()).fields["tokenizer.ggml.tokens"].data
    )


def test_the_pruned_trees_keep_what_the_servers_build_and_drop_the_rest(packed: Path) -> None:
    with tarfile.open(packed / "patched.tar.gz") as tar:
        names = set(tar.getnames())
    assert "include/llama.h" in names and "tools/server/server-context.cpp" in names
    assert ".polykv-patches.json" in names  # the record POLYKV_SERVERS_ONLY checks against this series
    assert any(n.startswith("ggml/src/ggml-cuda/") for n in names)
    assert any(n.startswith("ggml/src/ggml-cpu/") for n in names)
    dropped = ("models/", "docs/", "tests/", "ggml/src/ggml-sycl/", "ggml/src/ggml-metal/")
    assert not any(n.startswith(dropped) for n in names)
    with tarfile.open(packed / "pristine.tar.gz") as tar:
        assert ".polykv-patches.json" not in tar.getnames()  # the reference is built from the unpatched sources


def test_the_device_model_has_the_default_shape_and_tokenizer(packed: Path, tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    shape = device_check.write_model(packed, model, n_layer=2)
    reader = gguf.GGUFReader(model)
    default = gguf.GGUFReader(default_model_path())
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"):
        assert reader.fields[key].contents() == default.fields[key].contents(), key
    assert reader.fields["llama.block_count"].contents() == 2
    assert reader.fields["llama.embedding_length"].contents() == shape["embedding_length"]
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "blk.1.ffn_down.weight"} <= names and "blk.2.attn_q.weight" not in names


def test_fanout_rows_name_the_fastest_stock_mode() -> None:
    doc = {
        "cells": [
            {"system": "stock", "n": 16, "p": 1000, "rounds": [{"wall_s": 9.0}, {"wall_s": 8.0}]},
            {"system": "stock_queued", "n": 16, "p": 1000, "rounds": [{"wall_s": 7.0}, {"wall_s": 6.0}]},
            {"system": "patched", "n": 16, "p": 1000, "rounds": [{"wall_s": 4.0}, {"wall_s": 2.0}]},
        ]
    }
    (row,) = device_check.fanout_rows(doc)
    assert row["best_stock"] == "stock_queued" and row["speedup_vs_best_stock"] == 3.0


def test_a_check_without_a_kept_build_says_what_to_run_first(tmp_path: Path) -> None:
    """--stage check on a machine that holds no build (a cold device: the warm one went back) fails with the fix."""
    cfg = device_check.RunConfig(out=tmp_path / "out", work=tmp_path / "work", stage="check", backend="cpu")
    report = device_check.run(cfg)
    assert not report["ok"] and "run --stage build first" in report["error"]
    assert "run --stage build first" in (tmp_path / "out" / "device_check.md").read_text()


@pytest.mark.slow
def test_the_rehearsal_builds_both_servers_from_the_pack_and_passes(
    packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device's one command, on this machine: build, model, gate, backend checks, fan-out; the report says ok."""
    backend = REHEARSAL_BACKEND
    assert backend in ("cpu", "vulkan"), f"POLYKV_REHEARSAL_BACKEND={backend!r}: cpu or vulkan"
    if backend == "vulkan":  # ggml-vulkan leaves a CPU-type device (lavapipe) out unless it is named
        monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", os.environ.get("GGML_VK_VISIBLE_DEVICES", "0"))
    out = tmp_path / "out"
    report = device_check.run(
        device_check.RunConfig(
            out=out,
            pack_dir=packed,
            backend=backend,
            jobs=os.cpu_count() or 2,
            agents=(2, 4),
            prefix=256,
            gen=8,
            n_layer=4,
            base_tokens=400,
            sharers=3,
            n_predict=8,
            work=tmp_path / "work",
        )
    )
    page = (out / "device_check.md").read_text()
    assert report["ok"], page
    info = report["build"]["build_info"]
    assert info["patch_series_sha256"] == patchtool.series_hash()
    assert info["llama_cpp_source"] == str(tmp_path / "work" / "patched")  # built from the pack, not vendor/
    if backend == "vulkan":
        assert report["build"]["defines"]["GGML_VULKAN"] == "ON"
        assert report["devices"] and report["devices"][0].startswith("Vulkan0"), report["devices"]
    assert set(report["gate"]["checks"]) >= {"default_output", "share_hit", "fallback_miss", "auto_share", "share_any"}
    assert all(c["ok"] for c in report["gate"]["checks"].values()), page
    assert set(report["backend_checks"]["checks"]) == {"zero_config", "pool_files"}
    assert all(c["ok"] for c in report["backend_checks"]["checks"].values()), page
    assert "through openai" in report["backend_checks"]["checks"]["zero_config"]["summary"]
    assert [r["n"] for r in report["fanout"]] == [2, 4]
    assert all(r["speedup_vs_best_stock"] > 0 for r in report["fanout"])
    assert "| gate check | verdict |" in page and "| backend check | verdict |" in page and "speedup" in page

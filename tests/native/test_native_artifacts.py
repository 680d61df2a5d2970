"""The installed native build: extension stamps, build info, both servers, the tokenizer."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import patchtool  # scripts/, on sys.path through pytest's pythonpath option (pyproject.toml)
import pytest

from polykv_py.llama_server import LlamaServer
from polykv_py.native import build_info, server_binary

PIN = patchtool.read_pin()


def test_extension_reports_pinned_commit_and_series() -> None:
    from polykv_py._ffi import ffi, lib

    assert ffi.string(lib.polykv_upstream_commit()).decode() == PIN["upstream_commit"]
    # the installed wheel was built from this checkout's patch series
    assert ffi.string(lib.polykv_patch_series_sha256()).decode() == patchtool.series_hash()


def test_build_info_record() -> None:
    info = build_info()
    assert info["upstream_commit"] == PIN["upstream_commit"]
    assert info["patches"] == [p.name for p in patchtool.patch_files()]
    assert "CPU" in info["backends"]
    assert "NATIVE" not in info["cpu_flags"], (
        "the default build must not use -march=native (SIGILL, docs/design-notes.md)"
    )
    assert not any(f.startswith("AMX") for f in info["cpu_flags"]) or "AMX" in info["cpu_flags_source"]


@pytest.mark.parametrize("kind", ["patched", "upstream"])
def test_server_version(kind: str) -> None:
    out = subprocess.run(
        [str(server_binary(kind)), "--version"], check=False, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert f"commit {PIN['upstream_commit']}" in out.stdout + out.stderr


def test_help_lists_upstreams_idle_slot_names_first() -> None:
    helps = {
        k: subprocess.run([str(server_binary(k)), "--help"], check=False, capture_output=True, text=True, timeout=60)
        for k in ("patched", "upstream")
    }
    # 0072's aliases come after upstream's names; the reference has its own pristine common: upstream's names only
    assert "--cache-idle-slots, --clear-idle, --no-cache-idle-slots, --no-clear-idle" in helps["patched"].stdout
    assert "--cache-idle-slots, --no-cache-idle-slots" in helps["upstream"].stdout
    assert "--no-clear-idle" not in helps["upstream"].stdout


@pytest.mark.integration
def test_only_the_patched_server_knows_the_pool_fields(model_path: Path, tmp_path: Path) -> None:
    """Request fields are not in --help: send one with a bad value. The patched server refuses it
    naming the field; the reference server does not know the field and answers normally."""
    body = {"prompt": "Hello", "n_predict": 1, "shared_pool_slot": "zero"}
    for kind, want in (("patched", 400), ("upstream", 200)):
        with LlamaServer(model=model_path, kind=kind, args=["-c", "512", "-np", "2"], log_dir=tmp_path) as srv:
            resp = httpx.post(f"{srv.url}/completion", json=body, timeout=60)
            assert resp.status_code == want, (kind, resp.text)
            if kind == "patched":
                assert "shared_pool_slot" in resp.json()["error"]["message"]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["patched", "upstream"])
def test_server_answers_health_with_default_model(kind: str, model_path: Path, tmp_path: Path) -> None:
    with LlamaServer(model=model_path, kind=kind, args=["-c", "1024"], log_dir=tmp_path) as srv:
        assert srv.client.health().get("status") == "ok"
        assert srv.client.tokenize("Hello world")


@pytest.mark.integration
def test_cffi_tokenizer_round_trip(model_path: Path) -> None:
    from polykv_py.llama import Model

    text = "Shared context, computed once: 2,048 tokens for N agents."
    with Model(model_path) as model:
        tokens = model.vocab.tokenize(text, add_special=False)
        assert tokens and all(isinstance(t, int) for t in tokens)
        assert model.vocab.detokenize(tokens) == text

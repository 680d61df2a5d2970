"""The gate has teeth: its reference shares nothing with the patched build, and planted mutations make it fail.

- The reference server (``llama-server-upstream``) is built from the pristine tree with its own static ggml,
  llama and common (cmake/reference_server.cmake): it loads no library of the patched build and holds none of
  polykv's code.
- A planted ggml change (``mutations/rms_norm_eps.c``: ``ggml_rms_norm``'s epsilon doubled, preloaded into every
  server the gate starts) must make ``default_output`` fail. With the reference that loaded the patched build's
  shared libraries (before issue 39) the same environment changed both servers alike and the check passed.
- A planted off-by-one share (``mutations/share_off_by_one.cpp``: every share decision one cell longer) must make
  ``share_any`` fail, and by its answers, not only its counters.

The mutations are small shared objects compiled here with the system's compiler and given to the servers with
``LD_PRELOAD``: they wrap a function the patched server calls through the PLT of a shared library, as a one-line
change in that library would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from polykv_py.harness.gate import GateConfig, run_gate
from polykv_py.native import build_info

pytestmark = pytest.mark.integration

MUTATIONS = Path(__file__).parent / "mutations"
NATIVE = Path(__file__).resolve().parents[2] / "native"
#: Libraries of the patched build (the package's _native/lib) by name.
PATCHED_LIBS = ("libllama", "libggml", "libmtmd")
#: Text that only polykv's server code contains (log prefix, flags).
POLYKV_MARKERS = (b"polykv: ", b"--share-any", b"--no-clear-idle", b"shared_pool_slot")


def linked(binary: Path) -> dict[str, str]:
    """The shared libraries ``binary`` loads, name -> resolved path (``ldd``)."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    libs = {}
    for line in out.splitlines():
        name, _, rest = line.strip().partition(" => ")
        if rest:
            libs[name] = rest.split(" (")[0]
    return libs


def compile_mutation(source: Path, out_dir: Path) -> Path:
    """``source`` compiled to a shared object to preload (C, or C++ against the patched server's headers)."""
    out = out_dir / (source.stem + ".so")
    if source.suffix == ".c":
        cmd = [shutil.which("cc") or "cc", "-O2"]
    else:
        tree = Path(build_info()["llama_cpp_source"])
        includes = [NATIVE / "server", NATIVE / "llama", tree / "tools/server", tree / "common", tree / "include",
                    tree / "ggml/include", tree / "vendor", tree / "tools/mtmd"]  # fmt: skip
        cmd = [shutil.which("c++") or "c++", "-std=c++17", "-O1", *(f"-I{d}" for d in includes)]
    subprocess.run([*cmd, "-shared", "-fPIC", "-o", str(out), str(source), "-ldl"], check=True)
    return out


def failed_check_under(
    mutation: str, check: str, bins: tuple[Path, Path], model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    **cfg: Any,
) -> dict[str, Any]:  # fmt: skip
    """Gate ``check`` with ``mutation`` preloaded into every server it starts; the check must fail: its report."""
    monkeypatch.setenv("LD_PRELOAD", str(compile_mutation(MUTATIONS / mutation, tmp_path)))
    patched, upstream = bins
    config = GateConfig(model=model, patched_bin=patched, upstream_bin=upstream, log_dir=tmp_path, fresh_info=False,
                        checks=(check,), n_predict=8, **cfg)  # fmt: skip
    result: dict[str, Any] = run_gate(config)["checks"][check]
    assert not result["ok"], result["summary"]
    return result


def test_reference_loads_nothing_from_the_patched_build(patched_server_bin: Path, upstream_server_bin: Path) -> None:
    patched_lib_dir = patched_server_bin.resolve().parent.parent / "lib"
    ours = {n: p for n, p in linked(patched_server_bin).items() if Path(p).resolve().parent == patched_lib_dir}
    assert {n.split(".so")[0].split("-")[0] for n in ours} >= {"libllama", "libggml"}, ours  # the check can fail
    ref = linked(upstream_server_bin)
    assert not [n for n in ref if n.startswith(PATCHED_LIBS)], ref
    assert not [p for p in ref.values() if Path(p).resolve().parent == patched_lib_dir], ref
    blob = upstream_server_bin.read_bytes()
    assert not [m for m in POLYKV_MARKERS if m in blob], "the reference server holds polykv's code"
    impl = (patched_lib_dir / "libllama-server-impl.so").read_bytes()  # where the patched server's code lives
    assert all(m in impl for m in POLYKV_MARKERS)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the mutation")
def test_planted_ggml_change_fails_default_output(
    patched_server_bin: Path, upstream_server_bin: Path, model_path: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    check = failed_check_under("rms_norm_eps.c", "default_output", (patched_server_bin, upstream_server_bin),
                               model_path, tmp_path, monkeypatch)  # fmt: skip
    different = [c for c in check["cases"] if not c["ok"]]
    # every answer moved (probabilities at least): the mutation reached the patched server and not the reference
    assert len(different) == len(check["cases"]), json.dumps(check["cases"], indent=1)[:3000]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler to build the mutation")
def test_planted_off_by_one_share_fails_share_any(
    patched_server_bin: Path, upstream_server_bin: Path, model_path: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    check = failed_check_under("share_off_by_one.cpp", "share_any", (patched_server_bin, upstream_server_bin),
                               model_path, tmp_path, monkeypatch, base_tokens=400, n_sharers=2, ctx=4096)  # fmt: skip
    sharers = [c for c in check["cases"] if c["name"].startswith("sharer") and "cache_salt" not in c["name"]]
    assert len(sharers) == 2
    # the mutation acted (each share one cell longer than the prefix the prompts have in common) ...
    assert all(c["shared_prefix"]["shared"] == c["P"] + 1 for c in sharers), sharers
    # ... and the exact comparison sees it in the answers themselves, not only in the reported counts
    assert not any(c["identical_to_reference"] for c in sharers), sharers

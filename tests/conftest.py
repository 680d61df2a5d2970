"""Session fixtures shared by unit and integration tests.

Integration tests use the real binaries and the real default model; a missing
binary fails the test with the BuildError message (nothing is skipped).  At the
end of the session no llama-server started by this session may still run.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from polykv_py.errors import BuildError, ModelError
from polykv_py.models import resolve_model
from polykv_py.native import server_binary

#: Environment marker inherited by every server this session starts.
SESSION_MARKER = "POLYKV_TEST_SESSION"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: needs the built llama-server binaries and the default model")
    os.environ.setdefault(SESSION_MARKER, uuid.uuid4().hex)


def _required(get: Callable[[], Path]) -> Path:
    """``get()``; a missing binary or model fails the test with the reason (nothing is skipped)."""
    try:
        return get()
    except (BuildError, ModelError) as exc:
        pytest.fail(str(exc), pytrace=False)


#: The model families tests that take :func:`family_model` run on: llama (the default model) and Gemma 3
#: (sliding-window attention), by their :data:`polykv_py.models.KNOWN_MODELS` names (docs/models.md).
FAMILIES = ("smollm2-135m", "gemma3-270m")


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest) -> Path:
    """Each model family in turn (a test module's servers are started once per family)."""
    return _required(lambda: resolve_model(request.param))


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """Gemma 3 270M (sliding-window attention; fetched and verified on first use)."""
    return _required(lambda: resolve_model("gemma3-270m"))


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default GGUF (fetched and verified on first use)."""
    return _required(lambda: resolve_model(None))


@pytest.fixture(scope="session")
def patched_server_bin() -> Path:
    """The patched llama-server."""
    return _required(lambda: server_binary("patched"))


@pytest.fixture(scope="session")
def upstream_server_bin() -> Path:
    """The reference (pristine) llama-server."""
    return _required(lambda: server_binary("upstream"))


def session_servers() -> list[psutil.Process]:
    """llama-server processes started by this test session (descendants or marked by env)."""
    marker = os.environ.get(SESSION_MARKER)
    me = os.getpid()
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if "llama-server" not in (proc.info["name"] or "") and "llama-server" not in cmd:
                continue
            if proc.pid == me:
                continue
            ours = any(p.pid == me for p in proc.parents())
            if not ours and marker:
                ours = proc.environ().get(SESSION_MARKER) == marker
            if ours:
                found[proc.pid] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return list(found.values())


@pytest.fixture(scope="session", autouse=True)
def no_orphan_servers() -> Iterator[None]:
    """Fail the session if a llama-server it started outlives it (and kill the survivors)."""
    yield
    import gc

    gc.collect()  # run the finalizers of servers nobody references any more
    survivors: list[str] = []
    for proc in session_servers():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            survivors.append(f"pid {proc.pid}: {' '.join(proc.cmdline()[:3])}")
            proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    if survivors:
        desc = ", ".join(survivors)
        pytest.fail(f"llama-server processes survived the test session: {desc}", pytrace=False)

"""Fixtures that several integration modules share (the session's binaries and model: tests/conftest.py).

Each is module-scoped, so every module still gets its own directory, named after the module
(``test_pool_files`` -> ``pool-files``); a module that needs something else defines its own
fixture of the same name (test_pool_pinning.py: a log directory per test).
"""

from __future__ import annotations

from pathlib import Path

import pytest


def _module_dir_name(request: pytest.FixtureRequest) -> str:
    """``test_pool_files`` -> ``pool-files``."""
    return request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")


@pytest.fixture(scope="module")
def logs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for the module's server logs."""
    return tmp_path_factory.mktemp(f"{_module_dir_name(request)}-logs")


@pytest.fixture(scope="module")
def save_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's pool-file directory (the servers' ``--slot-save-path``), private to this user."""
    d = tmp_path_factory.mktemp(_module_dir_name(request))
    d.chmod(0o700)  # the server refuses a pool directory its group or others can write
    return d

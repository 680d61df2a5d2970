#!/usr/bin/env python3
"""A lavapipe (Mesa's Vulkan driver that runs on the CPU) that holds up under the pinned ggml-vulkan; prints the
loader variables that select it.

Debian 12's lavapipe (mesa-vulkan-drivers 22.3.6) kills llama-server, the stock one and ours alike, with SIGSEGV in
the driver's own thread (libvulkan_lvp.so): at random, in about half of the gate's checks with a 4-layer model,
and every time for two or four chat requests at once with ``-ub 128`` (docs/build.md, "Vulkan notes"). Mesa
25.0.7 from Debian 12's backports ran every one of those without a crash. This script gets that package
(pinned: version and sha256) by package name with apt and a private apt state, from the archive the system's
apt sources name (``vulkan_headers.fetch_deb``: nothing on the system changes), extracts it into
``$POLYKV_CACHE_DIR/vulkan/mesa-vulkan-drivers-<version>/``, writes an ICD manifest naming its
``libvulkan_lvp.so`` by absolute path, and prints::

    VK_DRIVER_FILES=<manifest> VK_ICD_FILENAMES=<manifest>

for ``export`` (the Vulkan loader then offers that driver alone). Its libraries (LLVM 15, libdrm, ...) are the
system's: install ``mesa-vulkan-drivers`` with apt first, which brings them. ggml-vulkan still leaves a CPU-type
device out unless it is named: ``GGML_VK_VISIBLE_DEVICES=0``.

  PYTHONPATH=src python scripts/lavapipe.py
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

from vulkan_headers import VulkanHeadersError, fetch_deb

from polykv_py.cache import cache_dir

log = logging.getLogger("lavapipe")

PACKAGE = "mesa-vulkan-drivers"
#: Debian 12 backports: version, architecture, sha256 of the .deb
PIN = ("25.0.7-2~bpo12+1", "amd64", "3899f1800424c60a05df5d6913076a526ca8fdbabec43672cd397563d1ca3263")
SUITE = "bookworm-backports"
LIB = Path("usr/lib/x86_64-linux-gnu/libvulkan_lvp.so")
ICD = Path("usr/share/vulkan/icd.d/lvp_icd.json")
MANIFEST = "lvp_icd.polykv.json"


def fetch(dest_root: Path) -> Path:
    """The ICD manifest of the pinned lavapipe under ``dest_root`` (fetched once)."""
    version = PIN[0]
    dest = dest_root / f"{PACKAGE}-{version}"
    manifest = dest / MANIFEST
    if manifest.is_file() and (dest / LIB).is_file():
        return manifest
    fetch_deb(PACKAGE, PIN, SUITE, dest)
    icd = json.loads((dest / ICD).read_text())
    icd["ICD"]["library_path"] = str(dest / LIB)
    manifest.write_text(json.dumps(icd, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="lavapipe: %(message)s", stream=sys.stderr)
    try:
        manifest = fetch(cache_dir() / "vulkan")
    except (VulkanHeadersError, OSError, KeyError, ValueError, subprocess.CalledProcessError) as exc:
        log.error("%s", exc)
        return 1
    log.info("%s %s: %s", PACKAGE, PIN[0], manifest)
    sys.stdout.write(f"VK_DRIVER_FILES={manifest} VK_ICD_FILENAMES={manifest}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

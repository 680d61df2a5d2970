#!/usr/bin/env python3
"""Vendor the pinned llama.cpp tree and maintain polykv's patch series.

Subcommands (all re-runnable):

  prepare  --dest vendor/llama.cpp --pristine vendor/llama.cpp-pristine
           fetch the pinned sdist (cached), unpack its vendor/llama.cpp/ into --dest and
           again into --pristine, apply patches/ to --dest only.  The pristine copy builds
           the reference server (cmake/reference_server.cmake) with its own ggml, llama
           and common: nothing the reference loads comes from the patched tree.
           With $POLYKV_LLAMA_CPP_DIR set, that local tree is used instead of --dest.
  apply    --tree DIR        apply patches/*.patch in lexical order, idempotently.
  check    --tree DIR        fail unless DIR records exactly this series as applied (no git).
  export   --tree DIR        write one patches/NNNN-name.patch per commit after the
           tag `upstream` of a git working copy (commit message = patch header).
  series-hash                print the sha256 of the patch series.

Patches are applied with `git apply` (works outside a git repository). A tree records
what was applied in `.polykv-patches.json` (with copies in `.polykv-applied/`): a second
run neither re-applies nor fails, and an edited patch is rolled back and re-applied.

The pinned sdist is fetched with polykv_py's pin, cache and error helpers, imported from
this source tree: run it from the repository root as `PYTHONPATH=src python
scripts/patchtool.py ...` (CMakeLists.txt runs it that way; see patches/README.md).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

from polykv_py.cache import cache_dir
from polykv_py.errors import PinError
from polykv_py.pins import PinnedPackage, fetch

ROOT = Path(__file__).resolve().parent.parent
PIN_FILE = ROOT / "vendor" / "llama.cpp.pin"
PATCH_DIR = ROOT / "patches"
#: polykv's own C++ (added to upstream's targets by native/polykv.cmake); part of the build stamp
NATIVE_DIR = ROOT / "native"
SOURCE_RECORD = ".polykv-source.json"
APPLIED_RECORD = ".polykv-patches.json"
APPLIED_DIR = ".polykv-applied"
LOCAL_TREE_ENV = "POLYKV_LLAMA_CPP_DIR"

log = logging.getLogger("patchtool")


class PatchToolError(RuntimeError):
    """A step failed; the message says what and what to do."""


# --------------------------------------------------------------------------- pin / fetch


def read_pin() -> dict[str, str]:
    with open(PIN_FILE, "rb") as f:
        return tomllib.load(f)


def fetch_sdist(pin: dict[str, str]) -> Path:
    """The pinned sdist from the cache, downloading it with pip on first use."""
    pinned = PinnedPackage(pin["package"], pin["version"], pin["sdist"], pin["sha256"], "sdist")
    try:
        return fetch(pinned, cache_dir() / "downloads")
    except PinError as exc:
        raise PatchToolError(str(exc)) from exc


def _extract(sdist: Path, prefix: str, dest: Path, record: dict[str, object]) -> None:
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    count = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if not member.name.startswith(prefix):
                continue
            rel = member.name[len(prefix) :]
            if not rel or rel == ".git":  # .git is a dangling submodule pointer in the sdist
                continue
            renamed = member.replace(name=rel)
            tar.extract(renamed, tmp, filter="data")
            count += renamed.isfile()
    if count == 0:
        shutil.rmtree(tmp)
        raise PatchToolError(f"{sdist.name} has no files under {prefix}")
    record = dict(record, files=count)
    (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    log.info("unpacked %d files into %s", count, dest)


def unpack(pin: dict[str, str], dest: Path, subdir: str = "") -> None:
    """Unpack the pinned tree (or one subdir of it) into dest, unless already there."""
    record = {
        "package": pin["package"],
        "version": pin["version"],
        "sha256": pin["sha256"],
        "upstream_commit": pin["upstream_commit"],
        "subdir": subdir,
    }
    existing = dest / SOURCE_RECORD
    if existing.is_file():
        old = json.loads(existing.read_text())
        if all(old.get(k) == v for k, v in record.items()):
            log.info("%s already holds %s %s%s", dest, pin["package"], pin["version"], f" ({subdir})" if subdir else "")
            return
        log.info("%s holds another source (%s); unpacking afresh", dest, old.get("version"))
    sdist = fetch_sdist(pin)
    prefix = pin["member_prefix"] + (subdir.rstrip("/") + "/" if subdir else "")
    _extract(sdist, prefix, dest, record)


# --------------------------------------------------------------------------- patches


def patch_files() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def native_files(native_dir: Path | None = None) -> list[Path]:
    """polykv's own sources under native/, sorted by path."""
    root = native_dir or NATIVE_DIR
    return sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def series_hash(patches: list[Path] | None = None, native_dir: Path | None = None) -> str:
    """The build stamp: sha256 over the names and contents of the series, in apply order, then of
    every file under native/ (the code the series calls), by relative path."""
    h = hashlib.sha256()
    for p in patches if patches is not None else patch_files():
        h.update(p.name.encode() + b"\0" + file_sha256(p).encode() + b"\n")
    root = native_dir or NATIVE_DIR
    for f in native_files(root):
        h.update(b"native/" + f.relative_to(root).as_posix().encode() + b"\0" + file_sha256(f).encode() + b"\n")
    return h.hexdigest()


def created_files(patch: Path) -> list[str]:
    """Files a patch creates (``--- /dev/null``): none are allowed, polykv's code lives in native/."""
    lines = patch.read_text().splitlines()
    return [b[6:] for a, b in itertools.pairwise(lines) if a == "--- /dev/null" and b.startswith("+++ b/")]


def _git_apply(tree: Path, patch: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # The tree usually sits inside polykv's own git checkout (vendor/ is ignored there).
    # Run from a subdirectory of a repository, `git apply` resolves paths from that
    # repository's root and silently skips the rest: stop discovery at the tree.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    return subprocess.run(
        ["git", "apply", "--whitespace=nowarn", *extra, str(patch)],
        check=False,
        cwd=tree,
        capture_output=True,
        text=True,
        env=env,
    )


def _touched_files(patch: Path) -> set[str]:
    return {line[6:] for line in patch.read_text().splitlines() if line.startswith("+++ b/")}


def _series_present(tree: Path, patches: list[Path]) -> bool:
    """True if ``patches`` (in series order) are all in ``tree``: undoing them newest first
    succeeds on a scratch copy of the files they touch.  A later patch may edit an earlier
    one's hunks, so each is checked against the tree with the later ones already undone."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="polykv-series-") as tmp:
        scratch = Path(tmp) / "tree"
        for rel in set().union(*(_touched_files(p) for p in patches)):
            if (tree / rel).is_file():
                (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(tree / rel, scratch / rel)
        scratch.mkdir(exist_ok=True)
        return all(_git_apply(scratch, p, "--reverse").returncode == 0 for p in reversed(patches))


def _unapply_stale(tree: Path, done: dict[str, str], wanted: dict[str, str]) -> dict[str, str]:
    """Reverse-apply, newest first, every recorded patch from the first one that changed.

    Copies of the applied patches are kept in the tree (APPLIED_DIR), so an edited
    series is rolled back hunk by hunk: only the files it touches change, and an
    incremental build stays incremental.
    """
    names = list(done)
    first_stale = next((i for i, n in enumerate(names) if wanted.get(n) != done[n]), None)
    if first_stale is None:
        return done
    for name in reversed(names[first_stale:]):
        copy = tree / APPLIED_DIR / name
        if not copy.is_file():
            raise PatchToolError(
                f"{tree} records {name} as applied but keeps no copy of it; "
                f"delete {tree} and build again to unpack a pristine tree."
            )
        res = _git_apply(tree, copy, "--reverse")
        if res.returncode != 0:
            raise PatchToolError(
                f"could not roll back the old {name} in {tree}:\n{res.stderr.strip()}\n"
                f"Delete {tree} and build again to unpack a pristine tree."
            )
        copy.unlink()
        del done[name]
        log.info("rolled back the old %s", name)
    return done


def apply_series(tree: Path) -> list[str]:
    """Apply patches/ to tree in lexical order; return the names applied now."""
    if shutil.which("git") is None:
        raise PatchToolError("git is required to apply patches (git apply); install git")
    patches = patch_files()
    record_path = tree / APPLIED_RECORD
    done: dict[str, str] = json.loads(record_path.read_text()) if record_path.is_file() else {}
    wanted = {p.name: file_sha256(p) for p in patches}
    for patch in patches:
        if created := created_files(patch):
            raise PatchToolError(
                f"{patch.name} creates {', '.join(created)}: a patch adds only call sites and build lines; "
                "put new code under native/ (native/polykv.cmake adds it to upstream's targets)"
            )
    done = _unapply_stale(tree, done, wanted)
    record_path.write_text(json.dumps(done, indent=2) + "\n")
    (tree / APPLIED_DIR).mkdir(exist_ok=True)
    applied_now = []
    for k, patch in enumerate(patches):
        if patch.name in done:
            continue
        check = _git_apply(tree, patch, "--check")
        if check.returncode == 0:
            res = _git_apply(tree, patch)
            if res.returncode != 0:
                raise PatchToolError(f"patch {patch.name} failed to apply:\n{res.stderr}")
            applied_now.append(patch.name)
            log.info("applied %s", patch.name)
        elif any(_series_present(tree, patches[k:j]) for j in range(len(patches), k, -1)):
            # it is in the tree, maybe with later patches on top (they may edit its hunks)
            log.info("%s is already in the tree; recording it", patch.name)
        else:
            raise PatchToolError(
                f"patch {patch.name} does not apply to {tree}:\n{check.stderr.strip()}\n"
                "Is the tree the pinned upstream commit? Refresh the patch with "
                "`python scripts/patchtool.py export --tree <your edited tree>`."
            )
        shutil.copy(patch, tree / APPLIED_DIR / patch.name)
        done[patch.name] = wanted[patch.name]
        record_path.write_text(json.dumps(done, indent=2) + "\n")
    return applied_now


def export_series(tree: Path, out: Path, base: str = "upstream") -> list[Path]:
    """Write one patch per commit base..HEAD of a git working copy; the message is the header."""
    revs = subprocess.run(
        ["git", "rev-list", "--reverse", f"{base}..HEAD"], cwd=tree, capture_output=True, text=True, check=True
    ).stdout.split()
    if not revs:
        raise PatchToolError(f"no commits after {base} in {tree}")
    pin = read_pin()
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for rev in revs:
        message = subprocess.run(
            ["git", "log", "-1", "--format=%B", rev], cwd=tree, capture_output=True, text=True, check=True
        ).stdout.strip()
        name = message.splitlines()[0].strip()
        if not name[:4].isdigit():
            raise PatchToolError(f"commit {rev[:10]}: first line must be NNNN-name, not {name!r}")
        diff = subprocess.run(
            ["git", "diff", "--no-color", "--no-renames", "--full-index", f"{rev}^", rev],
            cwd=tree,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        header = "\n".join(f"# {line}".rstrip() for line in message.splitlines())
        body = (
            f"{header}\n#\n# Applies to: {pin['upstream_repo']} {pin['upstream_commit']} "
            f"({pin['package']} {pin['version']} sdist), after the patches numbered below it.\n"
            f"# Refresh with: python scripts/patchtool.py export --tree <tree>\n\n{diff}"
        )
        target = out / f"{name}.patch"
        target.write_text(body)
        written.append(target)
        log.info("wrote %s", target)
    known = {p.name for p in written}
    for old in out.glob("*.patch"):
        if old.name not in known:
            log.warning("%s is not produced by this tree's commits (left in place)", old)
    return written


def check_applied(tree: Path) -> None:
    """Raise unless ``tree`` records exactly this checkout's series as applied (no git needed: a tree patched
    elsewhere and carried, as ``scripts/device_check.py`` packs one)."""
    record = tree / APPLIED_RECORD
    done = json.loads(record.read_text()) if record.is_file() else {}
    wanted = {p.name: file_sha256(p) for p in patch_files()}
    if done != wanted:
        stale = sorted({name for name, _ in set(done.items()) ^ set(wanted.items())})
        raise PatchToolError(
            f"{tree} does not hold this checkout's patch series ({APPLIED_RECORD} differs on {', '.join(stale)})"
        )


# --------------------------------------------------------------------------- prepare


def prepare(dest: Path, pristine: Path) -> Path:
    """Make the patched tree and the pristine tree ready; return the patched tree used."""
    pin = read_pin()
    local = os.environ.get(LOCAL_TREE_ENV)
    if local:
        tree = Path(local).expanduser().resolve()
        if not (tree / "include" / "llama.h").is_file():
            raise PatchToolError(f"${LOCAL_TREE_ENV}={local} is not a llama.cpp tree (no include/llama.h)")
        log.info("using the local llama.cpp tree %s", tree)
    else:
        tree = dest
        unpack(pin, dest)
    unpack(pin, pristine)
    if (pristine / APPLIED_RECORD).exists():
        raise PatchToolError(f"{pristine} has patches applied ({APPLIED_RECORD}): it must stay pristine; delete it")
    apply_series(tree)
    return tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--dest", type=Path, default=ROOT / "vendor" / "llama.cpp")
    p.add_argument("--pristine", type=Path, default=ROOT / "vendor" / "llama.cpp-pristine")
    p.add_argument("--print-tree", action="store_true", help="print the tree path on stdout")
    a = sub.add_parser("apply")
    a.add_argument("--tree", type=Path, required=True)
    e = sub.add_parser("export")
    e.add_argument("--tree", type=Path, required=True)
    e.add_argument("--out", type=Path, default=PATCH_DIR)
    e.add_argument("--base", default="upstream")
    c = sub.add_parser("check")
    c.add_argument("--tree", type=Path, required=True)
    sub.add_parser("series-hash")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="patchtool: %(message)s", stream=sys.stderr)
    try:
        if args.cmd == "prepare":
            tree = prepare(args.dest.resolve(), args.pristine.resolve())
            if args.print_tree:
                print(tree)
        elif args.cmd == "apply":
            apply_series(args.tree.resolve())
        elif args.cmd == "export":
            export_series(args.tree.resolve(), args.out.resolve(), args.base)
        elif args.cmd == "check":
            check_applied(args.tree.resolve())
        elif args.cmd == "series-hash":
            print(series_hash())
    except PatchToolError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

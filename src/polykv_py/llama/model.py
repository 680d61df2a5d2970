"""A loaded GGUF model that owns its ``llama_model`` and frees it."""

from __future__ import annotations

import hashlib
import logging
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._ffi import ffi, lib
from ..errors import ModelError
from ..models import resolve_model
from ._check import check_ptr
from ._owned import CGetter, OwnedPointer
from .backend import ensure_backend
from .vocab import Vocab

if TYPE_CHECKING:
    from .context import Context
    from .params import ContextParams

log = logging.getLogger(__name__)


class Model(OwnedPointer):
    """A GGUF model loaded with libllama.

    ``path`` defaults to ``$POLYKV_MODEL`` or the default model (see :mod:`polykv_py.models`).
    ``n_gpu_layers`` < 0 offloads every layer when a GPU backend exists (a no-op on CPU builds).
    Use as a context manager, or call :meth:`close`; closing also closes its contexts.
    """

    _what = "model"

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        n_gpu_layers: int = -1,
        use_mmap: bool = True,
        repack: bool = True,
        vocab_only: bool = False,
    ) -> None:
        self._ptr: Any = ffi.NULL
        self.path: Path = resolve_model(path)
        ensure_backend()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = int(n_gpu_layers)
        params.load_mode = lib.LLAMA_LOAD_MODE_MMAP if use_mmap else lib.LLAMA_LOAD_MODE_NONE
        params.use_extra_bufts = bool(repack)
        params.vocab_only = bool(vocab_only)
        ptr = lib.llama_model_load_from_file(os.fsencode(self.path), params)
        self._ptr = check_ptr(ptr, f"loading model {self.path}", ModelError)
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()
        self._sha256: str | None = None
        self.vocab = Vocab(self)
        log.debug("loaded %s (%s)", self.path, self.description)

    # -- ownership ------------------------------------------------------------------
    def _free(self, ptr: Any) -> None:
        """Close every context of this model, then free the model."""
        for ctx in list(self._contexts):
            ctx.close()
        lib.llama_model_free(ptr)

    def track_context(self, ctx: Context) -> None:
        """Close ``ctx`` when this model closes (every :class:`Context` calls this on creation)."""
        self._contexts.add(ctx)

    # -- properties -----------------------------------------------------------------
    n_ctx_train = CGetter(lib.llama_model_n_ctx_train, int, "Context length the model was trained with.")
    n_embd = CGetter(lib.llama_model_n_embd, int, "Embedding width.")
    n_layer = CGetter(lib.llama_model_n_layer, int, "Number of layers.")
    n_params = CGetter(lib.llama_model_n_params, int, "Number of parameters.")
    size = CGetter(lib.llama_model_size, int, "Bytes of all tensors.")

    @property
    def description(self) -> str:
        buf = ffi.new("char[]", 256)
        n = lib.llama_model_desc(self.ptr, buf, 256)
        return ffi.unpack(buf, max(0, min(n, 255))).decode("utf-8", "replace")

    @property
    def is_recurrent(self) -> bool:
        return bool(lib.llama_model_is_recurrent(self.ptr)) or bool(lib.llama_model_is_hybrid(self.ptr))

    @property
    def chat_template(self) -> str | None:
        """The model's default chat template, or None."""
        p = lib.llama_model_chat_template(self.ptr, ffi.NULL)
        return None if p == ffi.NULL else ffi.string(p).decode("utf-8", "replace")

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None if absent."""
        k = key.encode()
        n = lib.llama_model_meta_val_str(self.ptr, k, ffi.NULL, 0)
        if n < 0:
            return None
        buf = ffi.new("char[]", n + 1)
        lib.llama_model_meta_val_str(self.ptr, k, buf, n + 1)
        return ffi.string(buf).decode("utf-8", "replace")

    def sha256(self) -> str:
        """sha256 of the GGUF file (computed once, then cached)."""
        if self._sha256 is None:
            h = hashlib.sha256()
            with open(self.path, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            self._sha256 = h.hexdigest()
        return self._sha256

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this model in a saved state: file hash and shape."""
        return {
            "sha256": self.sha256(),
            "description": self.description,
            "n_params": self.n_params,
            "n_vocab": self.vocab.n_tokens,
            "n_layer": self.n_layer,
            "n_embd": self.n_embd,
        }

    # -- convenience ----------------------------------------------------------------
    def tokenize(self, text: str | bytes, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: list[int], *, remove_special: bool = False, unparse_special: bool = False) -> str:
        return self.vocab.detokenize(tokens, remove_special=remove_special, unparse_special=unparse_special)

    def context(self, params: ContextParams | None = None, **overrides: Any) -> Context:
        """Create a :class:`Context` on this model."""
        from .context import Context

        return Context(self, params, **overrides)

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.description
        return f"Model({str(self.path)!r}, {state})"

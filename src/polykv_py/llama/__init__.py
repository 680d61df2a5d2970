"""Pythonic layer over libllama: models, contexts, batches, KV memory, samplers, state.

Every object owns its C resource and frees it on ``close()`` / ``with`` exit; failures
surface as exceptions from :mod:`polykv_py.errors`. ``__all__`` is the one list of the
names this package exports. They are imported on first use (``__getattr__``), so the pure
modules (``params``, ``_kvstate``, ``_check``) work without the native extension, as does the
prefix-file format (:mod:`polykv_py.prefix_file`); the imports below are what type checkers read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._kvstate import KVUsage
    from .backend import ensure_backend, max_parallel_sequences, supports_gpu_offload, system_info
    from .batch import Batch
    from .context import Context
    from .memory import Memory
    from .model import Model
    from .params import ContextParams, SamplingParams
    from .sampler import Sampler
    from .shared_decode import (
        SharedDecodeStats,
        SharedDecodeTimes,
        set_shared_decode,
        shared_decode_enabled,
        shared_decode_stats,
        shared_decode_times,
    )
    from .vocab import Vocab

__all__ = [
    "Batch",
    "Context",
    "ContextParams",
    "KVUsage",
    "Memory",
    "Model",
    "Sampler",
    "SamplingParams",
    "SharedDecodeStats",
    "SharedDecodeTimes",
    "Vocab",
    "ensure_backend",
    "max_parallel_sequences",
    "set_shared_decode",
    "shared_decode_enabled",
    "shared_decode_stats",
    "shared_decode_times",
    "supports_gpu_offload",
    "system_info",
]

#: the submodules that define the exported names, searched in this order: the pure ones
#: first, so that their names never load the native extension.
_SUBMODULES = (
    "params",
    "_kvstate",
    "backend",
    "batch",
    "context",
    "memory",
    "model",
    "sampler",
    "shared_decode",
    "vocab",
)


def __getattr__(name: str) -> Any:
    if name in __all__:
        for sub in _SUBMODULES:
            module = importlib.import_module(f".{sub}", __name__)
            value = vars(module).get(name)
            if getattr(value, "__module__", None) == module.__name__:
                globals()[name] = value
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

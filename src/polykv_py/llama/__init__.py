"""Pythonic layer over libllama: models, contexts, batches, KV memory, samplers, state.

Every object owns its C resource and frees it on ``close()`` / ``with`` exit; failures
surface as exceptions from :mod:`polykv_py.errors`. Names are imported lazily, so the
pure modules (``params``, ``_kvstate``, ``_check``) work without the native extension.
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
    from .vocab import Vocab

_EXPORTS = {
    "Batch": "batch",
    "Context": "context",
    "ContextParams": "params",
    "KVUsage": "_kvstate",
    "Memory": "memory",
    "Model": "model",
    "Sampler": "sampler",
    "SamplingParams": "params",
    "Vocab": "vocab",
    "ensure_backend": "backend",
    "max_parallel_sequences": "backend",
    "supports_gpu_offload": "backend",
    "system_info": "backend",
}

__all__ = [
    "Batch",
    "Context",
    "ContextParams",
    "KVUsage",
    "Memory",
    "Model",
    "Sampler",
    "SamplingParams",
    "Vocab",
    "ensure_backend",
    "max_parallel_sequences",
    "supports_gpu_offload",
    "system_info",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)

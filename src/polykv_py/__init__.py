"""polykv: many LLM agents over one shared context on llama.cpp.

The base context's KV is stored and computed once in a pool slot of a patched
llama-server (or one sequence of an in-process libllama context) and shared into
every agent's sequence.
"""

from __future__ import annotations

from .errors import PolykvError
from .models import default_model_path, resolve_model
from .native import build_info, server_binary

__version__ = "0.1.0"

__all__ = ["PolykvError", "__version__", "build_info", "default_model_path", "resolve_model", "server_binary"]

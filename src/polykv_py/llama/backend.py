"""Process-wide libllama backend: one-time init, free at exit, and log routing.

libllama's own log lines go to the ``polykv_py.llama.native`` logger instead of
stderr: its INFO chatter at DEBUG, warnings and errors at their own level.
"""

from __future__ import annotations

import atexit
import logging
import threading

from .._ffi import ffi, lib

log = logging.getLogger(__name__)
native_log = logging.getLogger("polykv_py.llama.native")

_lock = threading.Lock()
_initialized = False
_last_level = logging.DEBUG

_LEVELS = {
    lib.GGML_LOG_LEVEL_NONE: logging.DEBUG,
    lib.GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
    lib.GGML_LOG_LEVEL_INFO: logging.DEBUG,
    lib.GGML_LOG_LEVEL_WARN: logging.WARNING,
    lib.GGML_LOG_LEVEL_ERROR: logging.ERROR,
}


@ffi.def_extern()
def _polykv_log_callback(level: int, text: object, user_data: object) -> None:
    """Sink for libllama log lines (called from C, possibly from worker threads)."""
    global _last_level
    try:
        py_level = _last_level if level == lib.GGML_LOG_LEVEL_CONT else _LEVELS.get(level, logging.DEBUG)
        _last_level = py_level
        if not native_log.isEnabledFor(py_level):
            return
        msg = ffi.string(text).decode("utf-8", errors="replace").rstrip("\n")
        if msg:
            native_log.log(py_level, "%s", msg)
    except Exception:  # an exception must never propagate into C
        pass


def ensure_backend() -> None:
    """Initialise the libllama backend once per process and route its logs to ``logging``."""
    global _initialized
    if _initialized:
        return
    with _lock:
        if _initialized:
            return
        lib.llama_log_set(lib._polykv_log_callback, ffi.NULL)
        lib.llama_backend_init()
        atexit.register(_free_backend)
        _initialized = True
        log.debug("libllama backend initialised")


def _free_backend() -> None:
    global _initialized
    if _initialized:
        lib.llama_backend_free()
        _initialized = False


def system_info() -> str:
    """libllama's system info line (CPU features and backends it was built with)."""
    ensure_backend()
    return ffi.string(lib.llama_print_system_info()).decode()


def max_parallel_sequences() -> int:
    """The largest ``n_seq_max`` a context accepts (``LLAMA_MAX_SEQ``)."""
    return int(lib.llama_max_parallel_sequences())


def supports_gpu_offload() -> bool:
    """Whether this libllama build can offload layers to a GPU."""
    return bool(lib.llama_supports_gpu_offload())

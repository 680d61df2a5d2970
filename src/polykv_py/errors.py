"""The one exception hierarchy of polykv.

Every error that polykv raises on purpose derives from :class:`PolykvError`, so
callers can catch the whole family with one ``except`` clause.  C-level failures
from libllama are turned into these exceptions in exactly one place
(``polykv_py.llama._check``), never scattered through the code.
"""

from __future__ import annotations


class PolykvError(Exception):
    """Base class of every polykv error."""


class BuildError(PolykvError):
    """The native build or one of its pinned inputs is missing or wrong."""


class PinError(BuildError):
    """A pinned download failed or its hash did not match."""


class ModelError(PolykvError):
    """A model could not be found, fetched, verified or loaded."""


class LlamaError(PolykvError):
    """libllama reported a failure (decode, memory operation, state I/O)."""


class ContextFullError(LlamaError):
    """The context has no room left for the requested tokens."""


class SequenceError(LlamaError, ValueError):
    """A sequence id or position range is out of range or refused."""


class StateError(LlamaError):
    """A saved sequence state does not belong to this model or token list."""


class TokenError(LlamaError, ValueError):
    """A token id is outside the model's vocabulary, or a token list is unusable (e.g. empty)."""


class ServerError(PolykvError):
    """A llama-server process failed to start, died, or misbehaved.

    ``log_tail`` carries the last lines of the server log, so the message says why.
    """

    def __init__(self, message: str, *, exit_status: int | None = None, log_tail: str = "") -> None:
        self.exit_status = exit_status
        self.log_tail = log_tail
        full = message
        if exit_status is not None:
            full += f" (exit status {exit_status})"
        if log_tail:
            full += "\n--- server log tail ---\n" + log_tail
        super().__init__(full)


class HTTPError(PolykvError):
    """The server answered a request with an error status.

    ``status`` is the HTTP status code and ``server_message`` the server's own text.
    """

    def __init__(self, status: int, server_message: str, *, url: str = "") -> None:
        self.status = status
        self.server_message = server_message
        self.url = url
        super().__init__(f"HTTP {status} from {url or 'server'}: {server_message}")


class ServerUnavailableError(ServerError):
    """The server could not be reached (connection refused, reset, or it died mid-request)."""


class GateError(PolykvError):
    """A gate check could not be run (as opposed to a check that ran and failed)."""


def first_line(exc: BaseException) -> str:
    """An error's message without the server log tail that ServerError appends."""
    return str(exc).split("\n--- server log tail ---", 1)[0]


def stale_connection(exc: BaseException) -> bool:
    """True when a request failed because a kept-alive connection had been closed by the server
    (nothing was received: safe to send again)."""
    import httpx

    return isinstance(exc, ServerUnavailableError) and isinstance(
        exc.__cause__, (httpx.RemoteProtocolError, httpx.ConnectError)
    )


def server_gone(exc: BaseException) -> bool:
    """True when a request failed because the server is gone, not because of this request: its
    process is known to have exited, or nothing accepts connections at its address any more."""
    import httpx

    return isinstance(exc, ServerUnavailableError) and (
        exc.exit_status is not None or isinstance(exc.__cause__, httpx.ConnectError)
    )

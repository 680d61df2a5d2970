"""The one alias for a JSON object: a request body or a response as the server sends it."""

from __future__ import annotations

from typing import Any

#: A JSON object as the server's HTTP API sends and takes it.
Json = dict[str, Any]

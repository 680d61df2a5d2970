"""Texts of a given length in tokens, for the bases and suffixes the harness and the tests send.

The tokenizer is the server's (``client.tokenize`` / ``client.detokenize``), so the length is
exactly what the server will count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Tokenize = Callable[[str], Sequence[Any]]
Detokenize = Callable[[list[Any]], str]


def cut_to_tokens(text: str, n_tokens: int, tokenize: Tokenize, detokenize: Detokenize) -> str:
    """The text of the first ``n_tokens`` tokens of ``text`` (all of it if it is shorter)."""
    return detokenize(list(tokenize(text)[:n_tokens]))


def repeat_to_tokens(
    piece: str, n_tokens: int, tokenize: Tokenize, detokenize: Detokenize, *, sep: str = "\n\n", margin: int = 8
) -> str:
    """``piece`` repeated (joined by ``sep``) until it is ``margin`` tokens longer than ``n_tokens``, then cut."""
    text = piece
    while len(tokenize(text)) < n_tokens + margin:
        text += sep + piece
    return cut_to_tokens(text, n_tokens, tokenize, detokenize)

"""Texts of a given token length (harness/texts.py), with a fake one-token-per-word tokenizer."""

from __future__ import annotations

from typing import Any

from bench.common import base_text, suffix_text
from polykv_py.harness.texts import cut_to_tokens, repeat_to_tokens


def tokenize(text: str) -> list[str]:
    return text.split(" ")


def detokenize(tokens: list[Any]) -> str:
    return " ".join(tokens)


def test_cut_and_repeat() -> None:
    assert cut_to_tokens("a b c d", 2, tokenize, detokenize) == "a b"
    assert cut_to_tokens("a b", 5, tokenize, detokenize) == "a b"
    text = repeat_to_tokens("x y", 5, tokenize, detokenize, sep=" ", margin=1)
    assert text == "x y x y x"


def test_bench_texts_have_the_asked_length() -> None:
    base = base_text(300, tokenize, detokenize)
    assert len(tokenize(base)) == 300
    suffixes = {suffix_text(i, 12, tokenize, detokenize, r) for i in range(4) for r in range(2)}
    assert len(suffixes) == 8 and all(len(tokenize(s)) == 12 for s in suffixes)

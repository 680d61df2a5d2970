"""Fixtures for the memory-API and engine tests: one loaded default model per session.

Sizes stay small (a prefix of about 200 tokens, at most 4 agents, at most 8 generated
tokens) because these tests run on 2 CPU cores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from memory_data import PREFIX_TEXT, SUFFIXES, THREADS

from polykv_py.llama import Context, Model


@pytest.fixture(scope="session")
def model(model_path: Path) -> Iterator[Model]:
    """The default model, loaded once (CPU)."""
    with Model(model_path, n_gpu_layers=0) as m:
        yield m


@pytest.fixture
def make_context(model: Model) -> Iterator[Callable[..., Context]]:
    """Factory for contexts (2 threads) that are all closed after the test."""
    made: list[Context] = []

    def make(**kw: Any) -> Context:
        kw.setdefault("n_threads", THREADS)
        ctx = model.context(**kw)
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        ctx.close()


@pytest.fixture(scope="session")
def prefix_tokens(model: Model) -> list[int]:
    return model.tokenize(PREFIX_TEXT)


@pytest.fixture(scope="session")
def suffix_tokens(model: Model) -> list[list[int]]:
    return [model.tokenize(s, add_special=False) for s in SUFFIXES]

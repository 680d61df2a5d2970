"""Parsed command-line options into the library's option objects."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    T = TypeVar("T", bound=DataclassInstance)


def options_from_args(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """``cls`` built from the options named like its fields (``--agent-slots`` fills ``agent_slots``), then
    ``values`` (options whose name or form differs, e.g. ``--no-shared-decode``); a field neither gives keeps
    its default."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**(given | values))

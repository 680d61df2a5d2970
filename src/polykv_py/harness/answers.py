"""Byte comparison of llama-server answers: the one list of fields that may differ between two runs.

The gate (:mod:`polykv_py.harness.gate`) and the tests that compare the patched server with
the reference server remove exactly :data:`VOLATILE_FIELDS` from both answers (and
:data:`SHARE_FIELDS` from an answer to a request that shared) and compare the rest byte
for byte: token counts, ``cache_n``, ``id_slot``, probabilities and ``generation_settings``
included.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

from ..jsontypes import Json

#: A non-stream body, or the list of SSE chunks of a stream (or a list of such answers).
Answer = Json | list[Any]

#: Response fields that legitimately differ between two runs of the same request
#: (wall-clock timings, random completion ids, wall-clock timestamps, the build id).
#: Dotted paths from the top of a response body or of each stream chunk. Nothing
#: else is removed before the byte comparison.
VOLATILE_FIELDS: tuple[str, ...] = (
    "timings.prompt_ms",
    "timings.prompt_per_token_ms",
    "timings.prompt_per_second",
    "timings.predicted_ms",
    "timings.predicted_per_token_ms",
    "timings.predicted_per_second",
    "created",
    "id",
    "system_fingerprint",
)

#: Fields only a request *with* pool fields may add; removed from the sharer's answer
#: (after they were checked) before comparing it with the reference server's answer.
SHARE_FIELDS: tuple[str, ...] = (
    "shared_prefix",
    "generation_settings.shared_pool_slot",
    "generation_settings.shared_prefix_n_tokens",
)


def strip_fields(doc: Answer, paths: Sequence[str] = VOLATILE_FIELDS) -> Answer:
    """A copy of ``doc`` (or of each answer or chunk of a list) without the dotted ``paths``."""
    if isinstance(doc, list):
        return [strip_fields(item, paths) if isinstance(item, dict | list) else item for item in doc]
    out = copy.deepcopy(doc)
    for path in paths:
        *parents, leaf = path.split(".")
        node: Any = out
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def canonical(doc: Answer) -> bytes:
    """The bytes compared: compact JSON in the server's key order."""
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


def first_difference(a: Any, b: Any, path: str = "$") -> str:
    """A short description of where two JSON values first differ ('' if equal)."""
    if type(a) is not type(b):
        return f"{path}: {_short(a)} != {_short(b)}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path} keys: {sorted(set(a) ^ set(b)) or 'order differs'}"
        pairs = [(a[k], b[k], f"{path}.{k}") for k in a]
    elif isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        pairs = [(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=True))]
    else:
        return "" if a == b else f"{path}: {_short(a)} != {_short(b)}"
    return next((d for x, y, where in pairs if (d := first_difference(x, y, where))), "")


def _short(v: Any) -> str:
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= 120 else s[:117] + "..."


def compare(
    a: Answer, b: Answer, strip_a: Sequence[str] = VOLATILE_FIELDS, strip_b: Sequence[str] = VOLATILE_FIELDS
) -> tuple[bool, str]:
    """Byte-compare two answers after removing the given fields; (equal, first difference)."""
    na, nb = strip_fields(a, strip_a), strip_fields(b, strip_b)
    if canonical(na) == canonical(nb):
        return True, ""
    return False, first_difference(na, nb) or "bytes differ"

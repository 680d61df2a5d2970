"""C results become the right exceptions (the mapping in polykv_py.llama._check)."""

from __future__ import annotations

import pytest

from polykv_py.errors import ContextFullError, LlamaError, PolykvError, SequenceError, StateError
from polykv_py.llama._check import check_decode, check_nonzero, check_seq_rm, check_template, check_true


def test_decode_codes() -> None:
    check_decode(0, 5)
    with pytest.raises(ContextFullError, match="full"):
        check_decode(1, 5)
    with pytest.raises(LlamaError, match="aborted"):
        check_decode(2, 5)
    with pytest.raises(LlamaError, match="invalid"):
        check_decode(-1, 5)
    with pytest.raises(LlamaError, match="fatal"):
        check_decode(-3, 5)
    with pytest.raises(LlamaError):
        check_decode(7, 5)


def test_seq_rm_false_is_a_sequence_error() -> None:
    check_seq_rm(True, 1, 0, 4)
    with pytest.raises(SequenceError, match=r"seq_rm\(seq_id=1, p0=0, p1=4\)"):
        check_seq_rm(False, 1, 0, 4)


def test_hierarchy() -> None:
    assert issubclass(SequenceError, LlamaError) and issubclass(SequenceError, ValueError)
    assert issubclass(ContextFullError, LlamaError) and issubclass(LlamaError, PolykvError)
    with pytest.raises(StateError):
        check_nonzero(0, "load", StateError)
    assert check_nonzero(3, "load") == 3
    with pytest.raises(LlamaError):
        check_true(False, "thing")


def test_sizes_and_templates() -> None:
    assert check_nonzero(8, "read", at_most=8) == 8
    with pytest.raises(LlamaError, match="returned 9"):
        check_nonzero(9, "read", at_most=8)
    assert check_template(0) == 0
    with pytest.raises(LlamaError, match="does not support this chat template"):
        check_template(-1)

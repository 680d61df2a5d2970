"""Pure parts of the engine and the settings objects (no native code)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from polykv_py.engine_types import (
    GenerationParams,
    context_params_for,
    find_stop,
    needed_cells,
    split_joint,
)
from polykv_py.llama.params import ContextParams, SamplingParams
from polykv_py.tokens import longest_common_prefix


def test_longest_common_prefix() -> None:
    assert longest_common_prefix([]) == 0
    assert longest_common_prefix([[1, 2, 3]]) == 3
    assert longest_common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert longest_common_prefix([[5], [6]]) == 0


def test_split_joint_handles_the_bpe_boundary() -> None:
    # the prefix alone ends in one merged token (9) that the full prompts split into (7, 8)
    prefix_alone = [1, 2, 9]
    fulls = [[1, 2, 7, 8, 10], [1, 2, 7, 8, 11, 12]]
    pre, sufs = split_joint(prefix_alone, fulls)
    assert pre == [1, 2, 7]
    assert sufs == [[8, 10], [8, 11, 12]]
    for s, f in zip(sufs, fulls, strict=True):
        assert pre + s == f


def test_split_joint_keeps_one_suffix_token() -> None:
    pre, sufs = split_joint([1, 2, 3], [[1, 2, 3], [1, 2, 3, 4]])
    assert pre == [1, 2] and sufs == [[3], [3, 4]]


def test_find_stop() -> None:
    assert find_stop("hello world", ["wor", "o"]) == 4
    assert find_stop("hello", ["x"]) == -1
    assert find_stop("hello", []) == -1


def test_needed_cells_and_context_params() -> None:
    assert needed_cells(100, [10, 20], 5, share=True, kv_unified=True) == 100 + 15 + 25
    assert needed_cells(100, [10, 20], 5, share=False, kv_unified=True) == 200 + 40
    assert needed_cells(100, [10, 20], 5, share=True, kv_unified=False) == 300 + 40
    p = context_params_for(4, 2048, 64, 32, base=ContextParams(n_threads=2))
    assert p.n_seq_max == 5 and p.n_ctx >= 2048 + 4 * 96 and p.n_ctx % 256 == 0 and p.n_threads == 2
    with pytest.raises(ValueError, match="n_agents"):
        context_params_for(0, 1, 1, 1)


def test_params_validation() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        GenerationParams(max_tokens=0)
    with pytest.raises(ValueError, match="stop"):
        GenerationParams(stop=("",))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**32 - 1)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(temperature=0.5, seed=3).with_seed(2**32).seed == 1
    ContextParams().validate()
    for bad in ({"n_ctx": 0}, {"n_seq_max": 300}, {"n_threads": 0}, {"flash_attn": "x"}, {"n_batch": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ContextParams(**bad).validate()  # type: ignore[arg-type]


def test_pure_names_need_no_native_extension() -> None:
    """The settings, the KV-state parser, the error mapping and the prefix-file format load no native code."""
    code = (
        "import sys\n"
        "from polykv_py.llama import ContextParams, KVUsage, SamplingParams\n"
        "import polykv_py.engine_types, polykv_py.llama._check, polykv_py.prefix_file\n"
        "assert 'polykv_py._ffi' not in sys.modules, sorted(m for m in sys.modules if m.startswith('polykv'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

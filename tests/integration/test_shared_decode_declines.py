"""``--shared-decode`` where the path must decline: flash attention off, or a q4_0 KV cache.

The CPU backend's shared-prefix decode path (patch 0076) only takes flash-attention nodes over
f16 or q8_0 KV; anything else stays on ggml's own kernels. A server given ``--shared-decode``
with ``-fa off`` or ``-ctk q4_0 -ctv q4_0`` must therefore say so once at start (a warning, not
the "on" line), report in ``/props`` that the path never ran (0 ops, 0 tiles), and answer a
primed pool's sharers, all sent at once, byte for byte like the same server started without
the option (:func:`~polykv_py.harness.answers.compare` minus
:data:`~polykv_py.harness.answers.VOLATILE_FIELDS`): the path never runs, so cell layout,
batching and rounding are the same.

The sharers go in one multi-prompt ``/completion``: the server queues its tasks together, so
every run batches them alike (one suffix batch, then one decode batch of every sharer per
step) and two servers can be compared byte for byte. The control runs the same workload with
flash attention on and f16 KV: there the path runs (the "on" line, ops counted for every decode
batch) and the answers are no longer byte-identical, which shows that this workload reaches the
path and that the byte comparison would see it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.multiturn import question_block
from polykv_py.client import Share
from polykv_py.data import sample_document
from polykv_py.harness.answers import compare
from polykv_py.harness.compare import LAYOUT, compare_greedy
from polykv_py.presets import SHARED_DECODE, pool_server

pytestmark = pytest.mark.integration

N_SHARERS = 6
GEN: dict[str, Any] = {"n_predict": 12, "temperature": 0.0, "n_probs": 5, "ignore_eos": True}
#: the document's first sections (about 500 tokens): the pool's base
_DOC = sample_document()
BASE = _DOC[: _DOC.index("\n\n", 2000)]
#: what the server logs at start (native/server/server-polykv.cpp, polykv_shared_decode_init)
DECLINE_LINE = "--shared-decode: needs flash attention and f16/q8_0 KV; attention keeps upstream's kernel"
ON_LINE = "polykv: --shared-decode on:"
#: flags under which the path must decline
DECLINES = {"fa-off": ("-fa", "off"), "q4_0": ("-fa", "on", "-ctk", "q4_0", "-ctv", "q4_0")}
#: flags under which it runs (the default f16 KV)
CONTROL = ("-fa", "on")
#: the default model's layers: the path counts one op per layer and decode batch
N_LAYER = 30


@dataclass(frozen=True)
class Run:
    """One server's answers to the sharers, its ``/props`` and its log."""

    answers: list[dict[str, Any]]
    props: dict[str, Any]
    log: str


def sharers_at_once(flags: tuple[str, ...], on: bool, binary: Path, model: Path, logs: Path, name: str) -> Run:
    """A fresh patched server with ``flags`` (and ``--shared-decode`` if ``on``): the pool primed with
    :data:`BASE`, then every sharer in one multi-prompt request."""
    extra = [*flags, SHARED_DECODE] if on else list(flags)
    srv = pool_server(binary=binary, model=model, n_agents_parallel=N_SHARERS, ctx=2048, threads=2, extra_args=extra,
                      track_kv=False, log_dir=logs, name=f"{name}-{'on' if on else 'off'}")  # fmt: skip
    with srv:
        c = srv.client
        c.prime(BASE, 0)
        prompts = [BASE + question_block(i, 0)[0] for i in range(N_SHARERS)]
        answers = c.completion(prompts, share=Share(0), **GEN)
        props = c.props()
    assert isinstance(answers, list) and len(answers) == N_SHARERS, answers
    for a in answers:  # every sharer took the pool's cells and computed only its question
        assert a["shared_prefix"]["status"] == "hit" and a["timings"]["prompt_n"] < 32, a["shared_prefix"]
    return Run(answers, props, srv.log_path.read_text(errors="replace"))


Pair = tuple[Run, Run]  # (without --shared-decode, with it)


@pytest.fixture(scope="module", params=sorted(DECLINES))
def declined(request: pytest.FixtureRequest, patched_server_bin: Path, model_path: Path, logs: Path) -> Pair:
    """The sharers on the server without the option and on the one with it, under flags where it declines."""
    flags = DECLINES[request.param]
    off, on = (sharers_at_once(flags, on, patched_server_bin, model_path, logs, request.param) for on in (False, True))
    return off, on


@pytest.fixture(scope="module")
def control(patched_server_bin: Path, model_path: Path, logs: Path) -> Pair:
    """The same with flash attention on and f16 KV, where the path runs."""
    off, on = (sharers_at_once(CONTROL, on, patched_server_bin, model_path, logs, "f16") for on in (False, True))
    return off, on


def test_the_server_says_once_that_the_path_declines(declined: Pair) -> None:
    off, on = declined
    assert on.log.count(DECLINE_LINE) == 1, on.log[-2000:]
    assert ON_LINE not in on.log
    assert "shared-decode" not in off.log


def test_props_show_that_the_path_never_ran(declined: Pair) -> None:
    off, on = declined
    stats = on.props["polykv_shared_decode"]
    assert {k: stats[k] for k in ("ops", "tiles_shared", "tiles_private", "tiles_skipped")} == dict.fromkeys(
        ("ops", "tiles_shared", "tiles_private", "tiles_skipped"), 0
    ), stats
    assert "polykv_shared_decode" not in off.props


def test_sharers_answer_byte_identically_to_the_server_without_it(declined: Pair) -> None:
    off, on = declined
    for i, (a, b) in enumerate(zip(off.answers, on.answers, strict=True)):
        same, diff = compare(a, b)
        assert same, f"sharer {i}: {diff}"


def test_control_the_path_runs_on_this_workload(control: Pair) -> None:
    off, on = control
    assert on.log.count(ON_LINE) == 1 and DECLINE_LINE not in on.log
    stats = on.props["polykv_shared_decode"]
    # one op per layer for the pool's prime (one batch of about 500 rows), the sharers' suffix batch and each
    # decode step but the last (whose token is not decoded)
    assert stats["enabled"] is True and stats["ops"] == N_LAYER * (1 + GEN["n_predict"]), stats
    assert stats["tiles_shared"] > 0, stats
    assert "polykv_shared_decode" not in off.props


def test_control_the_byte_comparison_sees_the_path(control: Pair) -> None:
    off, on = control
    assert any(not compare(a, b)[0] for a, b in zip(off.answers, on.answers, strict=True))
    for a, b in zip(off.answers, on.answers, strict=True):
        assert compare_greedy(a, b, margins=LAYOUT).ok, compare_greedy(a, b, margins=LAYOUT).detail

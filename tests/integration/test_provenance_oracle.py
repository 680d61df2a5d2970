"""The randomized provenance oracle (issue 34) against ``polykv serve``'s recipe, seeded, a few minutes.

Mixed traffic (:mod:`polykv_py.harness.oracle`): tenants with and without ``cache_salt``, a LoRA adapter applied
or not, ``n`` 1-3, salted ``n`` > 1 requests generating while other tenants ask over the same document, chunk
reuse followed by plain requests over the moved text, cancels mid-prompt, slot files, pool files, erases,
promotion and coalescing. Every take (a share, or a slot's own cache) is checked against the oracle's own ledger
(the cells must be the requester's tenant's and exact) and its answer against the reference server computing the
request fresh.

With the fix of either finding of issue 34 reverted, this seed finds it (docs/notes/provenance.md gives the runs):
an unsalted request sharing from the child of a salted ``n_cmpl`` request (``salt``), shifted cells shared as an
exact hit (``inexact`` and a ``different`` answer). ``POLYKV_ORACLE_SEED`` / ``POLYKV_ORACLE_ROUNDS`` change the
run; ``python -m bench.oracle`` is the longer soak run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from polykv_py.harness.lora import write_adapter
from polykv_py.harness.oracle import report_json, run_oracle
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import reference_server, serve_server

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("POLYKV_ORACLE_SEED", "34"))
ROUNDS = int(os.environ.get("POLYKV_ORACLE_ROUNDS", "24"))
AGENTS = (1, 2, 3, 4)
POOLS = (0,)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("lora") / "kv-lora.gguf")


@pytest.fixture(scope="module")
def servers(logs: Path, save_dir: Path, adapter: Path) -> Iterator[tuple[LlamaServer, LlamaServer]]:
    lora = ["--lora", str(adapter), "--lora-init-without-apply"]
    srv = serve_server(len(POOLS), agent_slots=len(AGENTS), ctx=8192, threads=2, slot_save_path=f"{save_dir}/",
                       log_dir=logs, name="oracle", extra_args=lora)  # fmt: skip
    ref = reference_server(n_slots=1, ctx=8192, threads=2, log_dir=logs, extra_args=lora)
    with srv.start(), ref.start():
        yield srv, ref


def test_every_take_is_the_requesters_and_exact(servers: tuple[LlamaServer, LlamaServer], logs: Path) -> None:
    srv, ref = servers
    report = run_oracle(srv.url, ref.url, seed=SEED, rounds=ROUNDS, agent_slots=AGENTS, pools=POOLS, lora=True)
    (logs / f"oracle-seed{SEED}.json").write_text(report_json(report))
    detail = "\n".join([report.summary(), *(f"{f.kind}: {f.detail}" for f in report.findings), *report.different])
    assert report.ok, detail
    # the run exercised what it is for
    assert {"ask", "reuse", "follow", "cancel"} <= set(report.ops), detail
    assert report.shares >= 5 and report.own_cache_takes >= 1 and report.compared >= 10, detail

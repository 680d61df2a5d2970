"""polykv's benchmarks: run from a source checkout (they are not part of the wheel).

Each module is a command, run from the checkout's root against the installed package::

    python -m bench.fanout --quick    # the fan-out grid (also `polykv bench` in a checkout)
    python -m bench.multiturn         # agents over one base for T turns
    python -m bench.decode            # the decode step with --shared-decode off and on
    python -m bench.restart           # a fan-out right after a restart: pool file vs computing again
    python -m bench.affinity          # routing across replicas behind smg (needs the cluster extra)
    python -m bench.engine            # the in-process engine: shared vs every agent from scratch
    python -m bench.reliability       # the load run plus the fault and hostile-input suites
    python -m bench.oracle            # the provenance soak: the randomized oracle, TTFT across salts
    python -m bench.zeroconfig        # zero-config sharing: plain chat agents, no pool declared
    python -m bench.agents            # the agent framework examples vs the stock server, same slots

Each writes its JSON and markdown under :data:`RESULTS` (``bench/results/``) unless ``--out`` says
otherwise. The checkers they share with the gate and the tests (KV cells from the server log, greedy
comparison, tables) stay in :mod:`polykv_py.harness`.
"""

from __future__ import annotations

from pathlib import Path

#: Where the benchmarks write by default: ``bench/results`` of this checkout.
RESULTS = Path(__file__).resolve().parent / "results"

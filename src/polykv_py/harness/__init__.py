"""The checkers the gate, the tests and the benchmarks share: the load test, greedy comparison, KV cells from
the server log, reports, and the gate itself (:mod:`polykv_py.harness.gate`)."""

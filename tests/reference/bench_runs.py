"""The benchmark smoke runs (tests/reference/workers/bench_worker.py RUNS), all in one launch at world 2 for the
session: each test_bench_* file reads its run's report."""

from __future__ import annotations

from tests.launch import run_worker
from tests.reference.demo_runs import json_lines


def bench_report(run: str) -> dict:
    """The JSON object the benchmark of `run` printed (`--json`, rank 0), from the shared launch."""
    output = "".join(rank[run] for rank in run_worker("bench_worker.py", 2, timeout=300))
    return json_lines(output)[0]

"""The demo's output for several argument lists, from one launch of workers/demo_worker.py per world.

A torchrun launch costs seconds before any work (the launcher, then each rank importing torch), so the
tests of one world hand all their argument lists to one launch; run_worker caches it for the session.
"""

from __future__ import annotations

import json

from tests.launch import run_worker


def demo_outputs(world: int, *runs: list[str], timeout: float = 300) -> list[str]:
    """Rank 0's stdout of each run of `torchrun --nproc-per-node world -m reference RUN`, in order."""
    results = run_worker("demo_worker.py", world, *(json.dumps(argv) for argv in runs), timeout=timeout)
    return results[0]["stdout"]


def json_lines(stdout: str) -> list[dict]:
    """The demo's --json records: the lines of its output that are JSON objects."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]

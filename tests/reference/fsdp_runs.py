"""Run tests/reference/workers/fsdp_worker.py once per (world size, device) and share its per-rank results.

Many named tests read the same launch (torchrun + torch import costs seconds on this machine), so the
results are cached for the pytest session.
"""
from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

from tests.launch import torchrun
from tests.reference.gpus import require_gpus

WORKER = Path(__file__).parent / "workers" / "fsdp_worker.py"


@functools.cache
def fsdp_results(world: int, device: str = "cpu") -> list[dict]:
    """Every rank's JSON from one `main` launch of the worker."""
    if device == "cuda":
        require_gpus(world)
    out = Path(tempfile.mkdtemp(prefix=f"fsdp-w{world}-{device}-"))
    torchrun(WORKER, world, str(out), "main", device, timeout=240)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def schedule(step: dict, phase: str | None = None) -> list[tuple]:
    """(op, unit, phase, nbytes, dtype) of each collective in issue order."""
    return [(e["op"], e["module"], e["phase"], e["nbytes"], e["dtype"]) for e in step["events"]
            if phase is None or e["phase"] == phase]


def issued(step: dict, op: str, unit: str, phase: str) -> float:
    """Issue time of the one `op` of `unit` in `phase` of a recorded step."""
    starts = [e["start"] for e in step["events"] if (e["op"], e["module"], e["phase"]) == (op, unit, phase)]
    assert len(starts) == 1, f"expected one {phase} {op} of {unit}, found {len(starts)}"
    return starts[0]


def span(step: dict, name: str) -> dict:
    spans = [s for s in step["spans"] if s["name"] == name]
    assert len(spans) == 1, f"expected one span {name!r}, found {len(spans)}"
    return spans[0]

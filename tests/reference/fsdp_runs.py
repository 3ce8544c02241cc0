"""The results of tests/reference/workers/fsdp_worker.py, launched once per (world size, device) and shared.

Many named tests read the same launch (torchrun + torch import costs seconds on this machine); run_worker
caches it for the pytest session.
"""

from __future__ import annotations

from tests.launch import run_worker


def fsdp_results(world: int, device: str = "cpu") -> list[dict]:
    """Every rank's JSON from the session's one launch of the worker at this world and device."""
    return run_worker("fsdp_worker.py", world, device=device, timeout=240)


def schedule(step: dict, phase: str | None = None) -> list[tuple]:
    """(op, unit, phase, nbytes, dtype) of each collective in issue order."""
    return [
        (e["op"], e["module"], e["phase"], e["nbytes"], e["dtype"])
        for e in step["events"]
        if phase is None or e["phase"] == phase
    ]


def issued(step: dict, op: str, unit: str, phase: str) -> float:
    """Issue time of the one `op` of `unit` in `phase` of a recorded step."""
    starts = [e["start"] for e in step["events"] if (e["op"], e["module"], e["phase"]) == (op, unit, phase)]
    assert len(starts) == 1, f"expected one {phase} {op} of {unit}, found {len(starts)}"
    return starts[0]


def span(step: dict, name: str) -> dict:
    spans = [s for s in step["spans"] if s["name"] == name]
    assert len(spans) == 1, f"expected one span {name!r}, found {len(spans)}"
    return spans[0]

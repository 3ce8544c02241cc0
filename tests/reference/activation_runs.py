"""Run tests/reference/workers/activation_worker.py once per (world size, device) and share its per-rank
results between the recomputation and the activation-memory tests."""
from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

from tests.launch import torchrun
from tests.reference.gpus import require_gpus

WORKER = Path(__file__).parent / "workers" / "activation_worker.py"


@functools.cache
def activation_results(world: int, device: str = "cpu") -> list[dict]:
    """Every rank's JSON from one launch of the worker."""
    if device == "cuda":
        require_gpus(world)
    out = Path(tempfile.mkdtemp(prefix=f"activation-w{world}-{device}-"))
    torchrun(WORKER, world, str(out), device, timeout=300)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


MEGATRON_WORKER = Path(__file__).parent / "workers" / "megatron_activation_worker.py"


@functools.cache
def megatron_activation_counts() -> dict:
    """Rank 0's counts of megatron-core's TransformerLayer (world 2, CPU/gloo), by configuration."""
    out = Path(tempfile.mkdtemp(prefix="megatron-activation-"))
    torchrun(MEGATRON_WORKER, 2, str(out), timeout=300)
    return json.loads((out / "rank0.json").read_text())

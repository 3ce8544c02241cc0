"""Run tests/reference/workers/activation_worker.py once per (world size, device) and share its per-rank
results between the recomputation and the activation-memory tests."""

from __future__ import annotations

from tests.launch import run_worker


def activation_results(world: int, device: str = "cpu") -> list[dict]:
    """Every rank's JSON from one launch of the worker."""
    return run_worker("activation_worker.py", world, device=device, timeout=300)


def megatron_activation_counts() -> dict:
    """Rank 0's counts of megatron-core's TransformerLayer (world 2, CPU/gloo), by configuration."""
    return run_worker("megatron_activation_worker.py", 2, timeout=300)[0]

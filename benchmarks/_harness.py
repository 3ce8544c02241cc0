"""What the bench_* scripts that compare implementations step by step share: timing them in turn, so that
machine noise hits them alike, and one recorded step of each for the bytes it sends."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from reference.measure.recorder import CollectiveRecorder


def interleaved_times(steps: dict[str, Callable[[], object]], rounds: int, cuda: bool) -> dict[str, list[float]]:
    """Seconds of each step, `rounds` times in turn: after a barrier, and on CUDA between two synchronizes."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return times


def recorded_traffic(steps: dict[str, Callable[[], object]]) -> dict[str, dict]:
    """One step of each under a CollectiveRecorder: its summary, per collective type."""
    traffic = {}
    for name, step in steps.items():
        with CollectiveRecorder() as rec:
            step()
        traffic[name] = rec.summary()
    return traffic

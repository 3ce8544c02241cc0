"""What the bench_* scripts share: their size flags, timing the implementations they compare in turn, so that
machine noise hits them alike, and one recorded step of each for the bytes it sends."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from reference.arguments import add_flag
from reference.measure.recorder import CollectiveRecorder


def add_sizes(parser, **defaults: int) -> None:
    """Whole-number size flags with these defaults, in this order: `batch_size` as --micro-batch-size (also
    spelled --batch-size), any other as its name (`seq_length`: --seq-length)."""
    for name, default in defaults.items():
        if name == "batch_size":
            add_flag(parser, "--micro-batch-size", "--batch-size", dest="batch_size", type=int, default=default)
        else:
            parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)


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

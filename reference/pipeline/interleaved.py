"""Interleaved 1F1B: each of the p stages holds v model chunks, and every micro-batch goes round the ring v times.

Rank r holds virtual stages r, p + r, ..., (v - 1) p + r. Its forwards follow one table, the same on every rank
(micro-batches in groups of p, each group through every chunk); its backwards follow that table with the chunks
reversed. Rank r runs w = min(2 (p - r - 1) + (v - 1) p, v m) warm-up forwards, then alternates, then drains;
the bubble shrinks to (p - 1) / (v m) of the ideal time.

Mirrors the order of actions per rank of
`megatron-lm:megatron/core/pipeline_parallel/schedules.py::forward_backward_pipelining_with_interleaving`,
not the moment of each transfer (reference.pipeline.p2p.RingP2P).
"""

from __future__ import annotations

import collections

from reference.parallel_state import ParallelConfigError
from reference.pipeline.p2p import RingP2P
from reference.pipeline.steps import GradSync, Steps


def check_interleaving(p: int, v: int, m: int) -> None:
    """Megatron refuses an interleaved step whose m is not a multiple of p (with its default group size p: the
    final group of fewer than p micro-batches would stall the ring)."""
    if v > 1 and p < 2:
        raise ParallelConfigError(f"{v} virtual pipeline stages need a pipeline of at least 2 stages, got {p}")
    if v > 1 and m % p:
        raise ParallelConfigError(
            f"interleaved 1F1B ({v} virtual stages) needs the number of micro-batches ({m}) "
            f"to be a multiple of the pipeline size ({p}), as megatron-core requires"
        )


def schedule_table(v: int, m: int, p: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each forward in the order every rank runs them: groups of p micro-batches, each
    through all v chunks.

    Mirrors `megatron-lm:megatron/core/pipeline_parallel/schedules.py::get_schedule_table`.
    """
    return [(i, c) for first in range(0, m, p) for c in range(v) for i in range(first, min(first + p, m))]


def warmup_forwards(p: int, r: int, v: int, m: int) -> int:
    """Forwards rank r runs before its first backward.

    Mirrors `megatron-lm:megatron/core/pipeline_parallel/schedules.py::get_pp_rank_microbatches`.
    """
    return min(2 * (p - r - 1) + (v - 1) * p, v * m)


def interleaved_order(p: int, r: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """("F" or "B", chunk, micro-batch) of every action of rank r, in order.

    Mirrors `pytorch:torch/distributed/pipelining/schedules.py::ScheduleInterleaved1F1B`.
    """
    check_interleaving(p, v, m)
    table, warmup = schedule_table(v, m, p), warmup_forwards(p, r, v, m)
    forwards = [("F", c, i) for i, c in table]
    backwards = [("B", v - 1 - c, i) for i, c in table]
    steady = [action for k in range(v * m - warmup) for action in (forwards[warmup + k], backwards[k])]
    return forwards[:warmup] + steady + backwards[v * m - warmup :]


def peak_in_flight(p: int, r: int, v: int, m: int) -> int:
    """Chunk-forwards whose backward has not run, at most, on rank r: the warm-up and the steady state's one."""
    return min(warmup_forwards(p, r, v, m) + 1, v * m)


def run_interleaved(steps: Steps, ring: RingP2P, sync: GradSync, p: int, r: int) -> None:
    """Run rank r's actions in interleaved_order, receiving each input just before it is needed.

    Mirrors
    `megatron-lm:megatron/core/pipeline_parallel/schedules.py::forward_backward_pipelining_with_interleaving`.
    """
    v, m = len(steps.chunks), len(steps.micro_batches)
    kept: dict[int, collections.deque] = {c: collections.deque() for c in range(v)}  # chunk -> (input, output)
    sync.disable()
    for kind, c, i in interleaved_order(p, r, v, m):
        starts_model, ends_model = r == 0 and c == 0, r == p - 1 and c == v - 1
        if kind == "F":
            input_tensor = None if starts_model else ring.recv_forward()
            output = steps.forward(i, input_tensor, chunk=c)
            if not ends_model:
                ring.send_forward(output)
            kept[c].append((input_tensor, output))
            continue
        output_grad = None if ends_model else ring.recv_backward()
        input_tensor, output = kept[c].popleft()
        if i == m - 1:  # this chunk's last backward: its gradients are complete, reduce them
            sync.enable()
        input_grad = steps.backward(i, input_tensor, output, output_grad, chunk=c)
        sync.disable()
        if not starts_model:
            ring.send_backward(input_grad)
    sync.enable()
    ring.wait_sends()

"""Pipeline schedules: in which order a stage runs the forwards (F) and backwards (B) of m micro-batches.

  GPipe: F0 .. F(m-1), then B0 .. B(m-1): every stage holds all m micro-batches.
  1F1B:  w = min(p - 1 - r, m) warm-up forwards on stage r, then one forward + one backward, then w
         backwards: stage r holds at most min(p - r, m). Interleaved: reference.pipeline.interleaved.
  Zero bubble (zb-h1, zbv, dualpipev), the backward split in two: reference.pipeline.zero_bubble.
Both idle for the bubble (p - 1) / (m + p - 1). Data parallelism plugs in as Megatron's config.no_sync_func
(left before the last backward) and config.finalize_model_grads_func. An optional observer wraps the
schedule and each action (reference.measure.pipeline_meter); the schedules measure nothing.

Counterparts:
`megatron-lm:megatron/core/pipeline_parallel/schedules.py::forward_backward_pipelining_without_interleaving`,
`megatron-lm:megatron/core/pipeline_parallel/schedules.py::forward_backward_no_pipelining` and
`pytorch:torch/distributed/pipelining/schedules.py::ScheduleGPipe`.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from reference.parallel_state import ParallelConfigError
from reference.pipeline import interleaved, zero_bubble
from reference.pipeline.p2p import PipelineP2P, RingP2P, StageP2P
from reference.pipeline.steps import GradSync, Steps
from reference.pipeline.zero_bubble_run import rank_of_stage, run_zero_bubble

SCHEDULES = ("gpipe", "1f1b")  # one backward pass each; the scale trace and the benchmark take these
ALL_SCHEDULES = (*SCHEDULES, *zero_bubble.ZERO_BUBBLE_SCHEDULES)  # forward_backward and -m reference


def bubble_formula(p: int, m: int, v: int = 1, schedule: str = "1f1b") -> float:
    """The idle fraction of GPipe, 1F1B and interleaved 1F1B with p stages, v chunks each and m uniform
    micro-batches: (p - 1) / (v m + p - 1), i.e. (p - 1) / (v m) of the ideal (bubble-free) time; of a
    zero-bubble schedule, reference.pipeline.zero_bubble.bubble_formula."""
    if schedule in zero_bubble.ZERO_BUBBLE_SCHEDULES:
        return zero_bubble.bubble_formula(schedule, p, m)
    return (p - 1) / (v * m + p - 1)


def peak_in_flight_formula(schedule: str, p: int, r: int, m: int, v: int = 1) -> int:
    """Forwards stage r of p holds at most: m under GPipe, min(p - r, m) under 1F1B, 1 without a pipeline;
    with v chunks (interleaved 1F1B) chunk-forwards, min(2 (p - r - 1) + (v - 1) p + 1, v m); zero bubble:
    reference.pipeline.zero_bubble.peak_in_flight."""
    if schedule in zero_bubble.ZERO_BUBBLE_SCHEDULES:
        return zero_bubble.peak_in_flight(schedule, p, r, m)
    if p == 1:
        return 1
    if v > 1:
        return interleaved.peak_in_flight(p, r, v, m)
    return m if schedule == "gpipe" else min(p - r, m)


def loss_values(losses: list[torch.Tensor]) -> list[float]:
    """The micro-batch losses as floats, read in one device-to-host copy after the schedule (not one sync
    per micro-batch inside it); NaN on the meta device, where reference.measure.scale runs stages on shapes only."""
    if not losses or losses[0].device.type == "meta":
        return [float("nan")] * len(losses)
    return torch.stack(losses).tolist()


def _no_pipelining(steps: Steps, sync: GradSync) -> None:
    """Mirrors `megatron-lm:megatron/core/pipeline_parallel/schedules.py::forward_backward_no_pipelining`."""
    m = len(steps.micro_batches)
    sync.disable()
    for i in range(m):
        if i == m - 1:
            sync.enable()
        steps.backward(i, None, steps.forward(i, None), None)


def _gpipe(steps: Steps, p2p: PipelineP2P, sync: GradSync) -> None:
    """Mirrors `pytorch:torch/distributed/pipelining/schedules.py::ScheduleGPipe`."""
    m, kept = len(steps.micro_batches), []
    sync.disable()
    for i in range(m):
        input_tensor = p2p.recv_forward()
        output = steps.forward(i, input_tensor)
        p2p.send_forward(output)
        kept.append((input_tensor, output))
    for i in range(m):
        if i == m - 1:
            sync.enable()
        input_tensor, output = kept[i]
        kept[i] = None  # drop the references: autograd frees the graph after the backward
        p2p.send_backward(steps.backward(i, input_tensor, output, p2p.recv_backward()))


def _one_f_one_b(steps: Steps, p2p: PipelineP2P, sync: GradSync) -> None:
    """Mirrors
    `megatron-lm:megatron/core/pipeline_parallel/schedules.py::forward_backward_pipelining_without_interleaving`.
    """
    m, p, r = len(steps.micro_batches), p2p.group.size(), p2p.group.rank()
    warmup = min(p - 1 - r, m)
    remaining = m - warmup
    queue: collections.deque[tuple[int, torch.Tensor | None, torch.Tensor]] = collections.deque()  # oldest first
    sync.disable()
    for i in range(warmup):
        input_tensor = p2p.recv_forward()
        output = steps.forward(i, input_tensor)
        p2p.send_forward(output)
        queue.append((i, input_tensor, output))
    input_tensor = p2p.recv_forward() if remaining else None
    for i in range(remaining):  # steady state: F(warmup + i), then B(i)
        last = i == remaining - 1
        output = steps.forward(warmup + i, input_tensor)
        output_grad = p2p.send_forward_recv_backward(output)
        queue.append((warmup + i, input_tensor, output))
        j, old_input, old_output = queue.popleft()
        if warmup == 0 and last:
            sync.enable()
        input_grad = steps.backward(j, old_input, old_output, output_grad)
        if last:
            p2p.send_backward(input_grad)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad)
    for i in range(warmup):  # cool-down
        if i == warmup - 1:
            sync.enable()
        j, old_input, old_output = queue.popleft()
        p2p.send_backward(steps.backward(j, old_input, old_output, p2p.recv_backward()))


def forward_backward(
    schedule: str,
    stage: torch.nn.Module | Sequence[torch.nn.Module],
    micro_batches: Sequence[tuple],
    *,
    pp_group: dist.ProcessGroup,
    activation_shape: tuple[int, ...],
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    finalize_grads: Callable[[], None] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    observer=None,
) -> list[float]:
    """Run forward and backward of every micro-batch on this stage with `schedule` ("gpipe", "1f1b", or a
    zero-bubble one of reference.pipeline.zero_bubble); return the micro-batch losses (before the 1/m scaling)
    on the rank holding the last stage (in a V, rank 0), else [].

    stage(*micro_batch, hidden=hidden) is called per micro-batch (hidden: None on the first stage, else received);
    on the last stage it returns the micro-batch's scalar loss. activation_shape: what goes between stages.
    `stage` may be a list of v model chunks (reference.gpt.parallelize.build_chunks): v > 1 runs interleaved 1F1B,
    and `no_sync` must then silence every chunk's gradient reduction. `observer`, if given, wraps the whole
    schedule in `observer.schedule(schedule, pp_group, v, m)` and each action in `observer.action(name)`.
    """
    if schedule not in ALL_SCHEDULES:
        raise ParallelConfigError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(ALL_SCHEDULES)}")
    if len(micro_batches) < 1:
        raise ParallelConfigError("the pipeline needs at least one micro-batch")
    chunks = list(stage) if isinstance(stage, Sequence) else [stage]
    p, r, v = pp_group.size(), pp_group.rank(), len(chunks)
    last_rank = p - 1
    if schedule in zero_bubble.ZERO_BUBBLE_SCHEDULES:
        zero_bubble.check_zero_bubble(schedule, p, len(micro_batches))
        stages = zero_bubble.stages_of(schedule, p, r)
        if v != len(stages):
            raise ParallelConfigError(f"--schedule {schedule} runs {len(stages)} model chunks per rank, got {v}")
        last_rank = rank_of_stage(p * v - 1, p)  # in a V, rank 0 holds the last stage too
    elif v > 1 and schedule != "1f1b":
        raise ParallelConfigError(f"{v} virtual pipeline stages need the 1f1b schedule (interleaved), not {schedule}")
    else:
        interleaved.check_interleaving(p, v, len(micro_batches))
    device = device or torch.device("cpu")
    steps, sync = Steps(chunks, micro_batches, is_last=r == last_rank, observer=observer), GradSync(no_sync)
    observed = (
        contextlib.nullcontext() if observer is None else observer.schedule(schedule, pp_group, v, len(micro_batches))
    )
    with observed:
        try:
            if schedule in zero_bubble.ZERO_BUBBLE_SCHEDULES:
                run_zero_bubble(schedule, steps, StageP2P(pp_group, activation_shape, dtype, device), sync, p, r)
            elif v > 1:
                interleaved.run_interleaved(steps, RingP2P(pp_group, activation_shape, dtype, device), sync, p, r)
            elif p == 1:
                _no_pipelining(steps, sync)
            else:
                p2p = PipelineP2P(pp_group, activation_shape, dtype, device)
                (_gpipe if schedule == "gpipe" else _one_f_one_b)(steps, p2p, sync)
        finally:  # a stage that raised must not leave the data-parallel wrapper with its sync turned off
            sync.enable()
    if finalize_grads is not None:
        finalize_grads()
    return loss_values(steps.losses)

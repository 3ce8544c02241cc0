"""Pipeline schedules: in which order a stage runs the forwards (F) and backwards (B) of m micro-batches.

  GPipe: F0 .. F(m-1), then B0 .. B(m-1). Every stage holds the activations of all m micro-batches.
  1F1B:  warm-up of w = min(p - 1 - r, m) forwards on stage r, then one forward + one backward until the
         forwards run out, then the remaining w backwards (cool-down). Stage r never holds more than
         min(p - r, m) micro-batches: p on the first stage, whatever m is.
Both idle for the same bubble, (p - 1) / (m + p - 1) of the time with uniform micro-batches: 1F1B saves
memory, not time. With one stage there is no pipeline: F0 B0 F1 B1 ...
  Interleaved 1F1B: 1F1B over v model chunks per stage (pass the v chunks as `stage`), reference.pipeline.
         interleaved; the bubble shrinks to (p - 1) / (v m + p - 1) of the time, (p - 1) / (v m) of the ideal.

Data parallelism plugs in as in Megatron when its config.grad_sync_func is unset: `no_sync`
(config.no_sync_func) is entered before the first micro-batch and left before the last backward on every
stage, so a DDP-like wrapper reduces gradients only once, and `finalize_grads`
(config.finalize_model_grads_func) runs after the last backward. (Megatron-LM's training sets grad_sync_func
under its default --align-grad-reduce: then only the first stage leaves no_sync before its last backward, the
others after it.) Each micro-batch's loss
is scaled by 1/m before its backward, so the gradients are those of the mean over micro-batches.

Counterparts: megatron/core/pipeline_parallel/schedules.py::forward_backward_pipelining_without_interleaving
(1F1B), ::forward_backward_no_pipelining (one stage), ::forward_step and ::backward_step; GPipe as in
torch/distributed/pipelining/schedules.py::ScheduleGPipe. Megatron can also free each sent output's data
(deallocate_output_tensor, under deallocate_pipeline_outputs: off in megatron-core, on in Megatron-LM's
training); this reference does not.

Measured, per stage: the action order and each action's start and end (perf_counter(), the clock of
reference.recorder) and, under a recorder, its FLOPs as the recorder counts them; the peak number of
micro-batches in flight both as the schedule counts them and as autograd really keeps them
(reference.pipeline.in_flight), and the bubble: the idle
fraction of the time between two barriers of the PP group around the schedule, the busy time being the sum
of this stage's forward and backward steps (their TP collectives included, the waits for p2p excluded).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from reference.parallel_state import ParallelConfigError
from reference.pipeline import interleaved
from reference.pipeline.p2p import PipelineP2P, RingP2P
from reference.pipeline.steps import GradSync, Steps

SCHEDULES = ("gpipe", "1f1b")


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """The idle fraction of any schedule here with p stages, v chunks each and m uniform micro-batches:
    (p - 1) / (v m + p - 1), i.e. (p - 1) / (v m) of the ideal (bubble-free) time."""
    return (p - 1) / (v * m + p - 1)


def peak_in_flight_formula(schedule: str, p: int, r: int, m: int, v: int = 1) -> int:
    """Forwards stage r of p holds at most: m under GPipe, min(p - r, m) under 1F1B, 1 without a pipeline;
    with v chunks (interleaved 1F1B) chunk-forwards, min(2 (p - r - 1) + (v - 1) p + 1, v m)."""
    if p == 1:
        return 1
    if v > 1:
        return interleaved.peak_in_flight(p, r, v, m)
    return m if schedule == "gpipe" else min(p - r, m)


@dataclasses.dataclass
class PipelineResult:
    """What one stage did in one forward_backward call."""

    schedule: str
    virtual_stages: int  # model chunks on this stage (v); > 1: interleaved 1F1B
    pp_rank: int
    pp_size: int
    num_micro_batches: int
    losses: list[float]  # last stage: each micro-batch's loss (before the 1/m scaling); else []
    actions: list[str]  # "F0", "B0", ... in the order run ("F<chunk>.<i>" with several chunks)
    action_spans: list[tuple[float, float]]  # (start, end) of each action: perf_counter(), the recorder's clock
    action_flops: list[int]  # FLOPs of each action as a CollectiveRecorder counted them (0 without one)
    start_s: float  # perf_counter() when the schedule started (after the PP barrier)
    peak_in_flight: int  # forwards whose backward had not run, as the schedule counted them
    peak_in_flight_measured: int  # micro-batches whose saved activations autograd still held
    peak_activation_bytes: int  # bytes of those saved activations at their peak
    total_s: float  # from start_s to the end of the schedule (its closing PP barrier)

    @property
    def busy_s(self) -> float:
        """Time in this stage's forward and backward steps: the sum of the action spans."""
        return sum(end - start for start, end in self.action_spans)

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def bubble_formula(self) -> float:
        return bubble_formula(self.pp_size, self.num_micro_batches, self.virtual_stages)

    def to_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "busy_s": self.busy_s,
            "bubble": self.bubble,
            "bubble_formula": self.bubble_formula,
        }


def loss_values(losses: list[torch.Tensor]) -> list[float]:
    """The micro-batch losses as floats, read in one device-to-host copy after the schedule (not one sync
    per micro-batch inside it); NaN on the meta device, where reference.scale runs stages on shapes only."""
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
) -> PipelineResult:
    """Run forward and backward of every micro-batch on this stage with `schedule` ("gpipe" or "1f1b").

    stage(hidden, *micro_batch) is called per micro-batch (hidden: None on the first stage, else received);
    on the last stage it returns the micro-batch's scalar loss. activation_shape: what goes between stages.
    `stage` may be a list of v model chunks (reference.gpt.model.build_chunks): v > 1 runs interleaved 1F1B,
    and `no_sync` must then silence every chunk's gradient reduction.
    """
    if schedule not in SCHEDULES:
        raise ParallelConfigError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if len(micro_batches) < 1:
        raise ParallelConfigError("the pipeline needs at least one micro-batch")
    chunks = list(stage) if isinstance(stage, Sequence) else [stage]
    p, r, v = pp_group.size(), pp_group.rank(), len(chunks)
    if v > 1 and schedule != "1f1b":
        raise ParallelConfigError(f"{v} virtual pipeline stages need the 1f1b schedule (interleaved), not {schedule}")
    interleaved.check_interleaving(p, v, len(micro_batches))
    device = device or torch.device("cpu")
    steps, sync = Steps(chunks, micro_batches, is_last=r == p - 1, device=device), GradSync(no_sync)
    if p > 1:  # a common start and end for the bubble measurement (Megatron has no such barriers)
        dist.barrier(group=pp_group)
    start = time.perf_counter()
    try:
        if v > 1:
            interleaved.run_interleaved(steps, RingP2P(pp_group, activation_shape, dtype, device), sync, p, r)
            if p > 1:
                dist.barrier(group=pp_group)
        elif p == 1:
            _no_pipelining(steps, sync)
        else:
            p2p = PipelineP2P(pp_group, activation_shape, dtype, device)
            (_gpipe if schedule == "gpipe" else _one_f_one_b)(steps, p2p, sync)
            dist.barrier(group=pp_group)
    finally:  # a stage that raised must not leave the data-parallel wrapper with its sync turned off
        sync.enable()
    total = time.perf_counter() - start
    if finalize_grads is not None:
        finalize_grads()
    return PipelineResult(
        schedule=schedule,
        virtual_stages=v,
        pp_rank=r,
        pp_size=p,
        num_micro_batches=len(micro_batches),
        losses=loss_values(steps.losses),
        actions=steps.actions,
        action_spans=steps.spans,
        action_flops=steps.flops,
        start_s=start,
        peak_in_flight=steps.peak_in_flight,
        peak_in_flight_measured=steps.meter.peak_micro_batches,
        peak_activation_bytes=steps.meter.peak_bytes,
        total_s=total,
    )

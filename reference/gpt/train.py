"""One 3D-parallel optimizer step: DP replicas take their rows, micro-batches go through the pipeline.

    global batch [B, s + 1] tokens, identical on every rank
      -> DP replica d takes rows [d B/dp, (d+1) B/dp)          (split_batch)
      -> m micro-batches of b = B / (dp m) rows, inputs tokens[:, :-1], labels tokens[:, 1:]
      -> forward_backward(schedule, ...) on this stage, loss of each micro-batch scaled by 1/m
      -> finalize_grads: sequence-parallel LayerNorm/bias grads summed over TP, then the mean over DP
      -> SGD step on this stage's parameters
The gradient is then that of the global batch's mean token loss, whatever tp, pp, dp and m are, so every
layout trains exactly like the unsharded model (up to fp32 summation order).

Reported loss: the global batch's mean, on every rank. The last stage averages its micro-batch losses,
all-reduces that over DP, and broadcasts it over the PP group from the last stage; these two small
collectives run after the step and outside any recorder (they are reporting, not training).

Counterparts: megatron/training/training.py::train_step (Megatron-LM, outside megatron-core) and
megatron/core/distributed/finalize_model_grads.py::finalize_model_grads, whose DP part the data-parallel
package (bucketed, overlapped) replaces through `no_sync` / `finalize_grads`.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from reference.gpt.model import GPTConfig, GPTStage
from reference.parallel_state import ParallelConfigError, ParallelLayout
from reference.pipeline.schedules import PipelineResult, forward_backward
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads


def synthetic_batches(config: GPTConfig, steps: int, global_batch_size: int, seed: int) -> list[torch.Tensor]:
    """`steps` global batches of random tokens [B, s + 1], identical on every rank for a given seed."""
    generator = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(config.vocab_size, (global_batch_size, config.seq_length + 1), generator=generator)
            for _ in range(steps)]


def split_batch(tokens: torch.Tensor, dp_size: int, dp_rank: int, num_micro_batches: int
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's rows of the global batch as m (inputs, labels) micro-batches."""
    rows, m = tokens.shape[0], num_micro_batches
    if m < 1 or rows % (dp_size * m):
        raise ParallelConfigError(f"a global batch of {rows} sequences does not split into dp {dp_size} x "
                                  f"{m} micro-batches of equal size; use a multiple of {dp_size * max(m, 1)}")
    mine = tokens.chunk(dp_size)[dp_rank]
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in mine.chunk(m)]


def finalize_grads(stage: torch.nn.Module, layout: ParallelLayout) -> None:
    """Sum the sequence-parallel partial grads over TP, then average every grad over DP in one flat
    all-reduce (as one DDP bucket would)."""
    allreduce_sequence_parallel_grads(stage, layout.tp_group)
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    if layout.dp_size > 1 and grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=layout.dp_group)
        for grad, reduced in zip(grads, flat.div_(layout.dp_size).split([g.numel() for g in grads])):
            grad.copy_(reduced.view_as(grad))


def global_loss(result: PipelineResult, layout: ParallelLayout, device: torch.device) -> float:
    """The global batch's mean loss on every rank (see the module docstring)."""
    loss = torch.tensor(sum(result.losses) / len(result.losses) if result.losses else 0.0, device=device)
    if result.pp_rank == result.pp_size - 1 and layout.dp_size > 1:
        dist.all_reduce(loss, group=layout.dp_group)
        loss /= layout.dp_size
    if layout.pp_size > 1:
        dist.broadcast(loss, src=dist.get_global_rank(layout.pp_group, layout.pp_size - 1), group=layout.pp_group)
    return loss.item()


@dataclasses.dataclass
class StepResult:
    loss: float               # the global batch's mean token loss (same on every rank)
    pipeline: PipelineResult  # this stage's schedule record


def train_step(stage: GPTStage, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, layout: ParallelLayout, *,
               num_micro_batches: int, schedule: str = "1f1b", device: torch.device | None = None,
               no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
               finalize: Callable[[], None] | None = None,
               record: contextlib.AbstractContextManager | None = None) -> StepResult:
    """One optimizer step on the global batch `tokens` [B, s + 1]. `finalize` replaces finalize_grads
    (e.g. a data-parallel wrapper's); `record` is a context (e.g. a CollectiveRecorder) around the training
    work only: schedule, gradient finalization and optimizer step."""
    device = device or torch.device("cpu")
    micro_batches = [(x.to(device), y.to(device))
                     for x, y in split_batch(tokens, layout.dp_size, layout.dp_rank, num_micro_batches)]
    with record or contextlib.nullcontext():
        result = forward_backward(
            schedule, stage, micro_batches, pp_group=layout.pp_group,
            activation_shape=stage.activation_shape(micro_batches[0][0].shape[0]), no_sync=no_sync,
            finalize_grads=finalize or (lambda: finalize_grads(stage, layout)), device=device)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=global_loss(result, layout, device), pipeline=result)

"""A GPipe step over one pipeline stage: all micro-batches forward, then all backward, with blocking
point-to-point send/recv between neighbouring stages (megatron/core/pipeline_parallel/p2p_communication.py
::P2PCommunicator sends the same tensors, batched).

Only the order differs from 1F1B (megatron/core/pipeline_parallel/schedules.py::
forward_backward_pipelining_without_interleaving): each micro-batch still crosses each stage boundary once
forward and once backward, so the per-step bytes the scale traces report do not depend on the schedule.
Stand-in until reference/pipeline lands.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference.parallel_state import ParallelLayout
from reference.scale.stage import Stage


def _neighbour(layout: ParallelLayout, offset: int) -> int:
    """Global rank of the stage `offset` away in this rank's pipeline."""
    p, d, t = layout.coordinates()
    return int(layout.grid[p + offset, d, t])


def _recv(shape, dtype, device, layout: ParallelLayout, offset: int) -> torch.Tensor:
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buffer, src=_neighbour(layout, offset), group=layout.pp_group)
    return buffer


def gpipe_step(stage: Stage, layout: ParallelLayout, tokens: list[torch.Tensor], labels: list[torch.Tensor],
               activation_shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
    """Forward then backward every micro-batch; the loss is the mean over micro-batches of the token mean."""
    inputs, outputs = [], []
    for mb_tokens, mb_labels in zip(tokens, labels):
        if stage.first:
            x = mb_tokens
        else:
            x = _recv(activation_shape, dtype, device, layout, -1).requires_grad_()
        y = stage(x, mb_labels)
        if not stage.last:
            dist.send(y.detach(), dst=_neighbour(layout, +1), group=layout.pp_group)
        inputs.append(x)
        outputs.append(y)
    for x, y in zip(inputs, outputs):
        if stage.last:
            (y.float().mean() / len(outputs)).backward()
        else:
            torch.autograd.backward(y, _recv(activation_shape, dtype, device, layout, +1))
        if not stage.first:
            dist.send(x.grad, dst=_neighbour(layout, -1), group=layout.pp_group)

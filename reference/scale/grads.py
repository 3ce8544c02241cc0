"""After backward, finish the step's gradients: the sequence-parallel partial sums over TP, then data
parallelism over DP, either as DDP (all-reduce the fp32 gradient buffer) or as Megatron's distributed
optimizer (reduce-scatter it, each rank updates its shard, all-gather the bf16 parameters).

Counterparts: megatron/core/distributed/finalize_model_grads.py::finalize_model_grads and
megatron/core/distributed/param_and_grad_buffer.py::_ParamAndGradBucketGroup.start_grad_sync /
start_param_sync. Here the buffer is one bucket (Megatron splits it into ~40M-element buckets, the same
bytes in more collectives) and the optimizer update itself is left out: only what goes over the wire.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference.parallel_state import ParallelLayout
from reference.scale.formulas import padded_buffer
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads


def finish_grads(model: torch.nn.Module, layout: ParallelLayout, dp_mode: str) -> None:
    allreduce_sequence_parallel_grads(model, layout.tp_group)
    if layout.dp_size == 1:
        return
    params = list(model.parameters())
    grads = torch.cat([p.grad.reshape(-1).float() for p in params])  # Megatron: the fp32 main-grad buffer
    if dp_mode == "allreduce":
        dist.all_reduce(grads.div_(layout.dp_size), group=layout.dp_group)
        return
    padded = padded_buffer(grads.numel(), layout.dp_size)
    grads = torch.nn.functional.pad(grads, (0, padded - grads.numel()))
    shard = torch.empty(padded // layout.dp_size, dtype=grads.dtype, device=grads.device)
    dist.reduce_scatter_single(shard, grads, group=layout.dp_group)
    # ... the optimizer updates this rank's shard of the parameters, then every rank gathers all of them
    local = torch.empty(padded // layout.dp_size, dtype=params[0].dtype, device=grads.device)
    gathered = torch.empty(padded, dtype=local.dtype, device=local.device)
    dist.all_gather_single(gathered, local, group=layout.dp_group)

"""A parameter group's two collectives, each through one flat buffer.

All-gather: copy every parameter's padded shard into this rank's slot of one flat buffer (copy-in), one
all-gather, then split each rank's slot back into each parameter's unsharded buffer (copy-out). Reduce: lay
each unsharded gradient's dim-0 chunks out rank by rank in one flat buffer (in `reduce_dtype`), one
reduce-scatter that averages it over the shard group, for HSDP one all-reduce that averages the result over the
replicas, then view each parameter's piece of the output as its sharded gradient.

Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py::foreach_all_gather`,
`pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py::foreach_all_gather_copy_out` and
`pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py::foreach_reduce`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from reference.distributed import all_gather_single, reduce_scatter_single
from reference.fsdp2.mesh import ShardMesh
from reference.fsdp2.param import ShardedParam


class AllGatherResult(NamedTuple):
    """An issued all-gather: the flat output, its pending work, and each parameter's share of a rank's slot."""

    output: torch.Tensor
    work: dist.Work | None  # None on one rank: the copy-in was the whole gather
    split_sizes: list[int]
    world: int


class PendingReduce(NamedTuple):
    """An issued reduction: the flat input (kept alive until it completes), output and pending work."""

    params: list[ShardedParam]
    input: torch.Tensor
    output: torch.Tensor
    work: dist.Work | None
    orig_dtype: torch.dtype


@torch.no_grad()
def foreach_all_gather(
    params: list[ShardedParam], group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device
) -> AllGatherResult:
    """Copy-in, then issue one all-gather of the group's shards; nothing waits here. On one rank the copy-in is
    the whole gather, and no collective is issued, as upstream.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py::foreach_all_gather`.
    """
    world, rank = group.size(), group.rank()
    inputs = [p.all_gather_input() for p in params]
    split_sizes = [t.numel() for t in inputs]
    slot = sum(split_sizes)
    output = torch.empty(slot * world, dtype=dtype, device=device)
    local = output.narrow(0, slot * rank, slot)  # the all-gather's input is this rank's slot of its output
    torch._foreach_copy_(list(local.split(split_sizes)), inputs)
    work = all_gather_single(output, local, group=group, async_op=True) if world > 1 else None
    return AllGatherResult(output, work, split_sizes, world)


@torch.no_grad()
def foreach_all_gather_copy_out(result: AllGatherResult, params: list[ShardedParam]) -> None:
    """Wait for the all-gather, then copy rank r's slot into chunk r of every parameter's unsharded buffer.
    Refilling a buffer that autograd saved in forward is not a modification autograd should see, so the
    buffers' version counters are left as they were.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py::foreach_all_gather_copy_out`.
    """
    if result.work is not None:
        result.work.wait()
    outs = [p.alloc_all_gather_output(result.world).view(result.world, -1) for p in params]
    with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
        torch.split_with_sizes_copy(result.output.view(result.world, -1), result.split_sizes, dim=1, out=outs)


@torch.no_grad()
def foreach_reduce(
    params: list[ShardedParam], grads: list[torch.Tensor], mesh: ShardMesh, reduce_dtype: torch.dtype
) -> PendingReduce:
    """Copy the gradients in (rank r's slot: chunk r of each, zero-padded), reduce-scatter them averaged over
    the shard group, and for HSDP all-reduce the result averaged over the replicas. Issued, not waited
    (`finish_reduce`); the all-reduce waits for the reduce-scatter it reduces. A shard group of one rank
    reduce-scatters nothing: its output is its input, as upstream.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py::foreach_reduce`.
    """
    world = mesh.shard_size
    slot = sum(p.shard_numel for p in params)
    flat = torch.zeros(world * slot, dtype=reduce_dtype, device=grads[0].device)  # padding reduces to zero
    chunk_cat(grads, [p.shard_numel for p in params], flat.view(world, slot))
    output = torch.empty(slot, dtype=reduce_dtype, device=flat.device)
    # Average inside the collective, as upstream does for fp32 and bf16; NCCL's AVG is wrong on one rank.
    op = dist.ReduceOp.AVG if world * mesh.replicas > 1 else dist.ReduceOp.SUM
    work = None
    if world > 1:
        work = reduce_scatter_single(output, flat, op=op, group=mesh.shard_group, async_op=True)
    else:
        output.copy_(flat)
    if mesh.replicate_group is not None:
        if work is not None:
            work.wait()
        work = dist.all_reduce(output, op=op, group=mesh.replicate_group, async_op=True)
    return PendingReduce(params, flat, output, work, params[0].orig_dtype)


def chunk_cat(grads: list[torch.Tensor], chunk_numels: list[int], out: torch.Tensor) -> None:
    """Row r of `out` (world x slot) gets chunk r of every gradient, each chunk `chunk_numels[i]` elements of
    the flattened gradient; rows past a gradient's end keep their zeros.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py::foreach_reduce_scatter_copy_in`.
    """
    offset = 0
    for grad, numel in zip(grads, chunk_numels):
        flat = grad.reshape(-1)
        full, rest = divmod(flat.numel(), numel)
        out[:full, offset : offset + numel] = flat[: full * numel].view(full, numel)
        if rest:
            out[full, offset : offset + rest] = flat[full * numel :]
        offset += numel


@torch.no_grad()
def finish_reduce(pending: PendingReduce) -> None:
    """Wait, cast back to the parameters' dtype, and give each parameter its piece as its sharded gradient."""
    if pending.work is not None:
        pending.work.wait()
    output = pending.output.to(pending.orig_dtype)
    offset = 0
    for param in pending.params:
        param.add_sharded_grad(output[offset : offset + param.shard_numel])
        offset += param.shard_numel

"""The tensor-parallel collectives on one dimension, each a few lines over torch.distributed.

Counterparts: megatron/core/tensor_parallel/mappings.py::_reduce, _split_along_last_dim,
_gather_along_last_dim, _split_along_first_dim, _gather_along_first_dim, _reduce_scatter_along_first_dim.
Every function is the identity on a group of one rank, so the same code runs unsharded at TP=1.
The `issue_*` variants return (output, work) for a caller that overlaps the collective with compute and
waits later (`wait(work)`); work is None when the call was synchronous or had nothing to communicate.
The first dimension is the sequence (layout [s, b, h], as in Megatron), the last one the hidden features.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference.distributed import all_gather_single, reduce_scatter_single
from reference.parallel_state import ParallelConfigError


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce `x` over the group (a sum unless `op` says otherwise), in place on a contiguous `x`.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_reduce`.
    """
    return issue_all_reduce(x, group, async_op=False, op=op)[0]


def issue_all_reduce(
    x: torch.Tensor, group: dist.ProcessGroup, async_op: bool, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> tuple[torch.Tensor, dist.Work | None]:
    """all_reduce, returning (output, work); work is None when nothing is left to wait for."""
    if group.size() == 1:
        return x, None
    x = x.contiguous()
    return x, dist.all_reduce(x, op=op, group=group, async_op=async_op)


def split_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous slice of the last dimension (no communication).

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_split_along_last_dim`.
    """
    if group.size() == 1:
        return x
    _check_divisible(x.shape[-1], group, "last dimension")
    return x.chunk(group.size(), dim=-1)[group.rank()].contiguous()


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension.

    One all-gather into a buffer stacked on dim 0, then a re-concatenation on the last dim; the wire traffic
    and the recorded collective are the same as Megatron's _gather_along_last_dim.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_gather_along_last_dim`.
    """
    if group.size() == 1:
        return x
    stacked = gather_first_dim(x, group)
    return torch.cat(stacked.chunk(group.size(), dim=0), dim=-1).contiguous()


def split_first_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous slice of the first (sequence) dimension (no communication).

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_split_along_first_dim`.
    """
    if group.size() == 1:
        return x
    _check_divisible(x.shape[0], group, "first (sequence) dimension")
    return x.chunk(group.size(), dim=0)[group.rank()].contiguous()


def gather_first_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather along the first dimension.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_gather_along_first_dim`.
    """
    return issue_gather_first_dim(x, group, async_op=False)[0]


def issue_gather_first_dim(
    x: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> tuple[torch.Tensor, dist.Work | None]:
    """gather_first_dim, returning (output, work) without waiting when async_op."""
    size = group.size()
    if size == 1:
        return x, None
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, all_gather_single(out, x.contiguous(), group=group, async_op=async_op)


def reduce_scatter_first_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the group and keep this rank's slice of the first dimension.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_reduce_scatter_along_first_dim`.
    """
    return issue_reduce_scatter_first_dim(x, group, async_op=False)[0]


def issue_reduce_scatter_first_dim(
    x: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> tuple[torch.Tensor, dist.Work | None]:
    """reduce_scatter_first_dim, returning (output, work) without waiting when async_op."""
    size = group.size()
    if size == 1:
        return x, None
    _check_divisible(x.shape[0], group, "first (sequence) dimension")
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, reduce_scatter_single(out, x.contiguous(), group=group, async_op=async_op)


def wait(work: dist.Work | None) -> None:
    """Wait for an `issue_*` collective; None (synchronous, or no collective at TP=1) is already complete."""
    if work is not None:
        work.wait()


def _check_divisible(n: int, group: dist.ProcessGroup, what: str) -> None:
    if n % group.size():
        raise ParallelConfigError(f"{what} of size {n} is not divisible by the tensor-parallel size {group.size()}")

"""The tensor-parallel collectives on one dimension, each a few lines over torch.distributed.

Counterparts: megatron/core/tensor_parallel/mappings.py::_reduce, _split_along_last_dim,
_gather_along_last_dim, _split_along_first_dim, _gather_along_first_dim, _reduce_scatter_along_first_dim.
Every function is the identity on a group of one rank, so the same code runs unsharded at TP=1.
The first dimension is the sequence (layout [s, b, h], as in Megatron), the last one the hidden features.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference.parallel_state import ParallelConfigError


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum `x` over the group, in place on a contiguous `x`."""
    if group.size() == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def split_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous slice of the last dimension (no communication)."""
    if group.size() == 1:
        return x
    _check_divisible(x.shape[-1], group, "last dimension")
    return x.chunk(group.size(), dim=-1)[group.rank()].contiguous()


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension.

    One all-gather into a buffer stacked on dim 0, then a re-concatenation on the last dim; the wire traffic
    and the recorded collective are the same as Megatron's _gather_along_last_dim.
    """
    if group.size() == 1:
        return x
    stacked = gather_first_dim(x, group)
    return torch.cat(stacked.chunk(group.size(), dim=0), dim=-1).contiguous()


def split_first_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous slice of the first (sequence) dimension (no communication)."""
    if group.size() == 1:
        return x
    _check_divisible(x.shape[0], group, "first (sequence) dimension")
    return x.chunk(group.size(), dim=0)[group.rank()].contiguous()


def gather_first_dim(x: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """All-gather along the first dimension; with async_op, returns (output, work) without waiting."""
    size = group.size()
    if size == 1:
        return (x, None) if async_op else x
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = dist.all_gather_single(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_first_dim(x: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Sum over the group and keep this rank's slice of the first dimension; async_op as above."""
    size = group.size()
    if size == 1:
        return (x, None) if async_op else x
    _check_divisible(x.shape[0], group, "first (sequence) dimension")
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = dist.reduce_scatter_single(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def _check_divisible(n: int, group: dist.ProcessGroup, what: str) -> None:
    if n % group.size():
        raise ParallelConfigError(f"{what} of size {n} is not divisible by the tensor-parallel size {group.size()}")

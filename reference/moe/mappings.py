"""The communication regions of the MoE dispatcher: one autograd Function per region, one public function each.

`all_to_all`: rank i sends `input_splits[j]` rows to rank j and receives `output_splits[j]` rows from it;
backward is the same exchange reversed (splits swapped), since the gradient of each row goes back to its
sender. Under expert tensor parallelism the tokens an EP rank received are gathered over the TP group, whose
ranks received different numbers of them, and the experts' partial outputs are reduce-scattered back:
`gather_tokens_over_tp` and `reduce_scatter_tokens_over_tp`, each the other's backward. gloo's all-gather
takes equal sizes only, so each rank's rows are padded to the largest count and the pad dropped after.

Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_AllToAll` and
`megatron-lm:megatron/core/tensor_parallel/mappings.py::_GatherFromSequenceParallelRegion` (with its
`output_split_sizes`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference.tensor_parallel import collectives as C


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, output_splits: list[int], input_splits: list[int]):
    """One all_to_all_single: `input_splits[j]` rows of `x` to rank j, `output_splits[j]` rows from it."""
    if group.size() == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Forward: the all-to-all with (output_splits, input_splits); backward: the same, splits swapped.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_AllToAll`.
    """

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _exchange(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def _gather_uneven(x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
    """Every rank's rows, rank by rank; rank j holds sizes[j] of them (padded to the largest on the wire)."""
    if group.size() == 1:
        return x
    pad = max(sizes)
    padded = torch.cat([x, x.new_zeros((pad - x.shape[0], *x.shape[1:]))])
    gathered = C.gather_first_dim(padded, group).split(pad)
    return torch.cat([chunk[:n] for chunk, n in zip(gathered, sizes)])


def _reduce_scatter_uneven(x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
    """Sum `x` [sum(sizes), ...] over the group and keep this rank's sizes[rank] rows (padded on the wire)."""
    if group.size() == 1:
        return x
    pad = max(sizes)
    chunks = [torch.cat([c, c.new_zeros((pad - n, *c.shape[1:]))]) for c, n in zip(x.split(sizes), sizes)]
    return C.reduce_scatter_first_dim(torch.cat(chunks), group)[: sizes[group.rank()]]


class _GatherTokensOverTP(torch.autograd.Function):
    """Forward: all-gather rows of uneven counts over TP; backward: reduce-scatter the gradient back.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_GatherFromSequenceParallelRegion`.
    """

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _gather_uneven(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_uneven(grad, ctx.group, ctx.sizes), None, None


class _ReduceScatterTokensOverTP(torch.autograd.Function):
    """Forward: reduce-scatter partial expert outputs over TP, uneven counts; backward: all-gather the gradient.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_ReduceScatterToSequenceParallelRegion`.
    """

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_uneven(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather_uneven(grad, ctx.group, ctx.sizes), None, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, output_splits: list[int], input_splits: list[int]):
    """The all-to-all region (backward: the reverse all-to-all). Megatron: tensor_parallel.all_to_all.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::all_to_all`.
    """
    return _AllToAll.apply(x, group, output_splits, input_splits)


def gather_tokens_over_tp(x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
    """Uneven all-gather / reduce-scatter. Megatron: gather_from_sequence_parallel_region(output_split_sizes=)."""
    return _GatherTokensOverTP.apply(x, group, sizes)


def reduce_scatter_tokens_over_tp(x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
    """Uneven reduce-scatter / all-gather. Megatron: reduce_scatter_to_sequence_parallel_region(input_split_sizes=)."""
    return _ReduceScatterTokensOverTP.apply(x, group, sizes)

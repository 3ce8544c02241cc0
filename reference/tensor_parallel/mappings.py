"""The communication regions of tensor parallelism: one autograd Function per region, one public function each.

A region pairs what forward does with what backward does as a tensor crosses between replicated and split over
TP. The Megatron-LM paper's f (`copy_to_tensor_parallel_region`: identity forward, all-reduce backward) opens a
block and its conjugate g (`reduce_from_tensor_parallel_region`) closes it; the sequence-parallel regions split
that all-reduce into an all-gather and a reduce-scatter.

Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_CopyToModelParallelRegion`,
`megatron-lm:megatron/core/tensor_parallel/mappings.py::_ReduceFromModelParallelRegion` and the other regions
of that file, each named on its Function here (notes/reference/tensor_parallel.mappings.md maps them all).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference.tensor_parallel import collectives as C


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: forward identity, backward all-reduce of the input gradient.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_CopyToModelParallelRegion`.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: forward all-reduce of the partial outputs, backward identity.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_ReduceFromModelParallelRegion`.
    """

    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim; backward: all-gather the gradient along it.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_ScatterToModelParallelRegion`.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return C.gather_last_dim(grad, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather along the last dim; backward: keep this rank's slice of the gradient.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_GatherFromModelParallelRegion`.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return C.split_last_dim(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the sequence; backward: all-gather the gradient along it.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_ScatterToSequenceParallelRegion`.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return C.gather_first_dim(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather the sequence; backward: reduce-scatter (or, for replicated compute, split).

    `tensor_parallel_output_grad=True` when what follows is tensor-parallel (a column-parallel layer): each
    rank's gradient is then partial and must be summed before it is split; False when what follows is
    replicated (e.g. a loss computed identically on every rank): the gradient is complete, just split it.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_GatherFromSequenceParallelRegion`.
    """

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.tensor_parallel_output_grad = group, tensor_parallel_output_grad
        return C.gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return C.reduce_scatter_first_dim(grad, ctx.group), None, None
        return C.split_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter partial outputs onto sequence slices; backward: all-gather the gradient.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::_ReduceScatterToSequenceParallelRegion`.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return C.gather_first_dim(grad, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """f (identity / all-reduce). Megatron: copy_to_tensor_model_parallel_region.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::copy_to_tensor_model_parallel_region`.
    """
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """g (all-reduce / identity). Megatron: reduce_from_tensor_model_parallel_region.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/mappings.py::reduce_from_tensor_model_parallel_region`.
    """
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """split last dim / all-gather last dim. Megatron: scatter_to_tensor_model_parallel_region."""
    return _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """all-gather last dim / split last dim. Megatron: gather_from_tensor_model_parallel_region."""
    return _GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """split sequence / all-gather sequence. Megatron: scatter_to_sequence_parallel_region."""
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """all-gather sequence / reduce-scatter (or split). Megatron: gather_from_sequence_parallel_region."""
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """reduce-scatter sequence / all-gather sequence. Megatron: reduce_scatter_to_sequence_parallel_region."""
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)

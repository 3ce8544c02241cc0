"""The kernel under both parallel linear layers: a matmul whose backward overlaps communication with compute.

Two ideas, each behind one flag. `async_grad_allreduce`: backward computes dX first, issues its all-reduce (or
reduce-scatter) without waiting and computes dW while the bytes are on the wire. `gradient_accumulation_fusion`:
dW is accumulated straight into an fp32 `weight.main_grad`. With sequence parallelism the gathered input is not
saved; backward gathers it again, overlapped with the dX GEMM. Inside a zero-bubble schedule's input-gradient
pass, dW and db are left for later (reference.tensor_parallel.deferred_wgrad).

Mirrors `megatron-lm:megatron/core/tensor_parallel/layers.py::linear_with_grad_accumulation_and_async_allreduce`
and `megatron-lm:megatron/core/tensor_parallel/layers.py::LinearWithGradAccumulationAndAsyncCommunication.backward`
(notes/reference/tensor_parallel.linear_kernel.md: what each flag changes, and what turning it off keeps).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference.tensor_parallel import collectives as C
from reference.tensor_parallel import deferred_wgrad


class LinearWithAsyncGradReduce(torch.autograd.Function):
    """Y = X W^T (+ b); backward: dX collective overlapped with the dW GEMM, dW optionally into main_grad."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        group,
        allreduce_dgrad,
        sequence_parallel,
        async_grad_allreduce,
        gradient_accumulation_fusion,
    ):
        """Mirrors
        `megatron-lm:megatron/core/tensor_parallel/layers.py::LinearWithGradAccumulationAndAsyncCommunication.forward`.
        """
        ctx.save_for_backward(x, weight)
        ctx.use_bias = bias is not None
        ctx.params = (weight, bias)  # the Parameters themselves (saved_tensors gives other objects): for W
        ctx.group, ctx.allreduce_dgrad, ctx.sequence_parallel = group, allreduce_dgrad, sequence_parallel
        ctx.async_grad_allreduce, ctx.fusion = async_grad_allreduce, gradient_accumulation_fusion
        total_x = C.gather_first_dim(x, group) if sequence_parallel else x
        out = torch.matmul(total_x, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        """Mirrors
        `megatron-lm:megatron/core/tensor_parallel/layers.py::LinearWithGradAccumulationAndAsyncCommunication.backward`.
        """
        x, weight = ctx.saved_tensors
        group, overlap = ctx.group, ctx.async_grad_allreduce
        # with SP, re-gather the input for dW, in flight during the dX GEMM
        total_x, gather_work = C.issue_gather_first_dim(x, group, overlap) if ctx.sequence_parallel else (x, None)
        grad_x = grad_out.matmul(weight)
        C.wait(gather_work)

        reduce_work = None
        if ctx.allreduce_dgrad:  # f's backward, fused here so it can overlap the dW GEMM below
            grad_x, reduce_work = C.issue_all_reduce(grad_x, group, overlap)
        elif ctx.sequence_parallel:
            grad_x, reduce_work = C.issue_reduce_scatter_first_dim(grad_x, group, overlap)

        grad_out_2d = grad_out.reshape(-1, grad_out.shape[-1])
        total_x_2d = total_x.reshape(-1, total_x.shape[-1])
        grad_weight = grad_bias = None
        if not deferred_wgrad.stash(*ctx.params, total_x_2d, grad_out_2d, ctx.fusion):  # else W computes them
            grad_weight, grad_bias = deferred_wgrad.weight_gradients(
                weight, ctx.use_bias, total_x_2d, grad_out_2d, ctx.fusion
            )

        C.wait(reduce_work)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def linear_with_grad_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup,
    *,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    async_grad_allreduce: bool = True,
    gradient_accumulation_fusion: bool = False,
) -> torch.Tensor:
    """The only entry point to the kernel (megatron: linear_with_grad_accumulation_and_async_allreduce).

    Mirrors `megatron-lm:megatron/core/tensor_parallel/layers.py::linear_with_grad_accumulation_and_async_allreduce`.
    """
    if allreduce_dgrad and sequence_parallel:
        raise ValueError("allreduce_dgrad and sequence_parallel are exclusive: SP reduce-scatters dX instead")
    if gradient_accumulation_fusion and not hasattr(weight, "main_grad"):
        raise ValueError("gradient_accumulation_fusion needs a `main_grad` buffer on the weight")
    return LinearWithAsyncGradReduce.apply(
        x, weight, bias, group, allreduce_dgrad, sequence_parallel, async_grad_allreduce, gradient_accumulation_fusion
    )

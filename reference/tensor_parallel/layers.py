"""Column- and row-parallel linear layers, with Megatron-core's argument names and (output, bias) return.

ColumnParallelLinear splits the weight by output features: each rank computes a slice of Y, and its input
gradient is partial, hence the all-reduce in backward. RowParallelLinear splits it by input features: each rank
computes a partial sum, reduced in forward, then adds the bias once. Column then row needs no communication
in between. The process group is passed explicitly instead of read from a ModelParallelConfig.

Mirrors `megatron-lm:megatron/core/tensor_parallel/layers.py::ColumnParallelLinear.forward`,
`megatron-lm:megatron/core/tensor_parallel/layers.py::RowParallelLinear.forward` and
`megatron-lm:megatron/core/tensor_parallel/layers.py::_initialize_affine_weight_cpu`
(notes/reference/tensor_parallel.layers.md works the split out).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from reference.parallel_state import ParallelConfigError, divide
from reference.tensor_parallel.linear_kernel import linear_with_grad_reduce
from reference.tensor_parallel.mappings import (
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)


def shard_of(master: torch.Tensor, partition_dim: int, group: dist.ProcessGroup, stride: int = 1) -> torch.Tensor:
    """This rank's slice of a full tensor: with stride k the dimension is read as k consecutive parts (e.g. the
    [gate; up] of a SwiGLU fc1, k = 2) and the rank takes its 1/p of each, so a rank's gate and up columns meet.

    Megatron splits its master weight the same way (`stride`).

    Mirrors `megatron-lm:megatron/core/tensor_parallel/layers.py::_initialize_affine_weight_cpu`.
    """
    p = group.size()
    chunks = master.chunk(stride * p, dim=partition_dim)
    return torch.cat(chunks[group.rank() :: p], dim=partition_dim)


def init_shard_from_master(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    partition_dim: int,
    init_method: Callable[[torch.Tensor], object],
    group: dist.ProcessGroup,
    stride: int = 1,
) -> None:
    """Build the full fp32 master weight on every rank from the global RNG, keep this rank's slice.

    Same recipe as megatron's _initialize_affine_weight_cpu: equal seeds give equal shards here and in
    megatron-core, and the unsharded model built after the same seed holds their concatenation (stride 1;
    with stride k, each rank's k parts, see shard_of).

    Mirrors `megatron-lm:megatron/core/tensor_parallel/layers.py::_initialize_affine_weight_cpu`.
    """
    master = torch.empty(output_size, input_size, dtype=torch.float32)
    init_method(master)
    with torch.no_grad():
        weight.copy_(shard_of(master.to(weight.dtype), partition_dim, group, stride))


class _ParallelLinear(torch.nn.Module):
    """Parameters and checks shared by both layers, and the keyword arguments both take (`shared` in theirs):
    init_method, bias, sequence_parallel, async_grad_allreduce, gradient_accumulation_fusion, params_dtype,
    device, return_bias (False: return the output alone, as the nn.Linear that parallelize replaces),
    explicit_expert_comm (an expert's layer: the MoE dispatcher gathers its input over TP and reduce-scatters its
    output, so the layer reduces neither its input gradient nor its output, as megatron's `is_expert` layers).
    Subclasses decide how the weight is split."""

    def __init__(
        self,
        weight_shape,
        bias_size,
        *,
        tp_group: dist.ProcessGroup,
        init_method: Callable,
        partition_dim: int,
        input_size: int,
        output_size: int,
        stride: int = 1,
        bias: bool = True,
        sequence_parallel: bool = False,
        async_grad_allreduce: bool = True,
        gradient_accumulation_fusion: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        return_bias: bool = True,
        explicit_expert_comm: bool = False,
    ):
        super().__init__()
        self.input_size, self.output_size, self.tp_group = input_size, output_size, tp_group
        self.return_bias, self.explicit_expert_comm = return_bias, explicit_expert_comm
        if explicit_expert_comm and sequence_parallel:
            raise ParallelConfigError(f"{type(self).__name__}: an expert's layer is not sequence-parallel")
        self.sequence_parallel = sequence_parallel and tp_group.size() > 1  # as Megatron: off at TP=1
        self.async_grad_allreduce = async_grad_allreduce
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.weight = torch.nn.Parameter(torch.empty(weight_shape, dtype=params_dtype, device=device))
        self.partition_dim, self.stride = partition_dim, stride
        init_shard_from_master(self.weight, output_size, input_size, partition_dim, init_method, tp_group, stride)
        if gradient_accumulation_fusion:
            self.weight.main_grad = torch.zeros(weight_shape, dtype=torch.float32, device=device)
        if bias:  # Megatron zero-initializes biases
            self.bias = torch.nn.Parameter(torch.zeros(bias_size, dtype=params_dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def _returned(self, output: torch.Tensor, bias: torch.Tensor | None):
        return (output, bias) if self.return_bias else output

    def _check_input(self, x: torch.Tensor, expected_last: int) -> None:
        name = type(self).__name__
        if x.dtype != self.weight.dtype:
            raise ParallelConfigError(f"{name}: input dtype {x.dtype} does not match weight dtype {self.weight.dtype}")
        if x.device != self.weight.device:
            raise ParallelConfigError(f"{name}: input on {x.device} but weight on {self.weight.device}")
        if x.shape[-1] != expected_last:
            raise ParallelConfigError(f"{name}: input last dimension {x.shape[-1]}, expected {expected_last}")


class ColumnParallelLinear(_ParallelLinear):
    """Y_i = X A_i (+ b_i): weight [output_size / p, input_size], bias split with the output.

    gather_output: all-gather Y along the last dim so every rank holds the full output.
    skip_bias_add: return the bias instead of adding it, so the caller can fuse the add.
    stride: the output features are `stride` consecutive parts, each split 1/p (see shard_of).
    sequence_parallel: the input is split along the sequence (dim 0) and all-gathered inside the kernel;
    its gradient is reduce-scattered back instead of all-reduced.
    `shared`: the keyword arguments of both layers (_ParallelLinear; init_method is required).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: dist.ProcessGroup,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        stride: int = 1,
        **shared,
    ):
        per_rank = divide(output_size, stride * tp_group.size(), "ColumnParallelLinear output_size") * stride
        super().__init__(
            (per_rank, input_size),
            per_rank,
            tp_group=tp_group,
            partition_dim=0,
            input_size=input_size,
            output_size=output_size,
            stride=stride,
            **shared,
        )
        self.output_size_per_partition = per_rank
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mirrors `megatron-lm:megatron/core/tensor_parallel/layers.py::ColumnParallelLinear.forward`."""
        self._check_input(input_, self.input_size)
        output_parallel = linear_with_grad_reduce(
            input_,
            self.weight,
            None if self.skip_bias_add else self.bias,
            self.tp_group,
            allreduce_dgrad=self.tp_group.size() > 1 and not self.sequence_parallel and not self.explicit_expert_comm,
            sequence_parallel=self.sequence_parallel,
            async_grad_allreduce=self.async_grad_allreduce,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
        )
        output = (
            gather_from_tensor_parallel_region(output_parallel, self.tp_group)
            if self.gather_output
            else output_parallel
        )
        return self._returned(output, self.bias if self.skip_bias_add else None)


class RowParallelLinear(_ParallelLinear):
    """Y = sum_i X_i A_i + b: weight [output_size, input_size / p], bias replicated and added after the sum.

    input_is_parallel: the input is already split along its last dim (the output of a column layer);
    otherwise it is split here. sequence_parallel: reduce-scatter the output along the sequence instead
    of all-reducing it (requires input_is_parallel). skip_bias_add and `shared` as in ColumnParallelLinear.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: dist.ProcessGroup,
        input_is_parallel: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        **shared,
    ):
        if sequence_parallel and not input_is_parallel:
            raise ParallelConfigError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        per_rank = divide(input_size, tp_group.size(), "RowParallelLinear input_size")
        super().__init__(
            (output_size, per_rank),
            output_size,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            partition_dim=1,
            input_size=input_size,
            output_size=output_size,
            **shared,
        )
        self.input_size_per_partition = per_rank
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        if self.bias is not None and self.explicit_expert_comm and self.tp_group.size() > 1:
            raise ParallelConfigError(
                "RowParallelLinear: an expert's row layer at TP > 1 has no bias (its sum is not here)"
            )
        if self.bias is not None and self.sequence_parallel:
            self.bias.sequence_parallel = True  # each rank sees a slice of the tokens: its grad is partial

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mirrors `megatron-lm:megatron/core/tensor_parallel/layers.py::RowParallelLinear.forward`."""
        if self.input_is_parallel:
            self._check_input(input_, self.input_size_per_partition)
            input_parallel = input_
        else:
            self._check_input(input_, self.input_size)
            input_parallel = scatter_to_tensor_parallel_region(input_, self.tp_group)
        output_parallel = linear_with_grad_reduce(
            input_parallel,
            self.weight,
            None,
            self.tp_group,
            allreduce_dgrad=False,
            sequence_parallel=False,
            async_grad_allreduce=self.async_grad_allreduce,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
        )
        if self.explicit_expert_comm:  # partial sums: the MoE dispatcher reduce-scatters them
            output = output_parallel
        elif self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        else:
            output = reduce_from_tensor_parallel_region(output_parallel, self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return self._returned(output, self.bias if self.skip_bias_add else None)
        return self._returned(output + self.bias, None)


def allreduce_sequence_parallel_grads(module: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Sum over TP the grads of replicated parameters that saw only this rank's tokens (SP only).

    Under sequence parallelism LayerNorm weights and row-parallel biases are replicated but applied to a
    slice of the sequence, so each rank's gradient is partial. Megatron does this after backward in
    megatron/core/distributed/finalize_model_grads.py::_allreduce_non_tensor_model_parallel_grads.

    Mirrors `megatron-lm:megatron/core/distributed/finalize_model_grads.py::_allreduce_non_tensor_model_parallel_grads`.
    """
    grads = [getattr(p, "main_grad", p.grad) for p in module.parameters() if getattr(p, "sequence_parallel", False)]
    grads = [g for g in grads if g is not None]  # main_grad: the DP wrapper's fp32 view, as Megatron reduces
    if grads and group.size() > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))

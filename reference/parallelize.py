"""`parallelize(model, layout, config)`: a plain GPT stage made parallel, one step per dimension, in order.

1. tensor and sequence parallelism, the vocabulary split over TP (reference.gpt.parallelize.parallelize_gpt);
2. expert parallelism of every MoE layer (reference.moe.parallelize.parallelize_moe);
3. context parallelism: the stage holds its cp shard, attention rings over cp
   (reference.context_parallel.parallelize.parallelize_context);
4. activation recomputation per block (reference.recompute.set_recompute);
5. the DP form, one knob named by its ZeRO stage (`DP_SHARDING`), over dp x cp.

The model file never mentions ranks; each step swaps or wraps what the previous one left. A list of interleaved
chunks is parallelized chunk by chunk (each its own DDP wrapper, as megatron wraps each model chunk). Mirrors
torchtitan's `parallelize_llama` (TP, activation checkpointing, then `fully_shard` or `replicate`), whose steps
are `megatron-lm:megatron/core/models/gpt/gpt_model.py::GPTModel.__init__`'s layers here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from reference.context_parallel.parallelize import parallelize_context
from reference.data_parallel.buckets import GradBucket
from reference.data_parallel.distributed_optimizer import DistributedOptimizer
from reference.data_parallel.fsdp2_tp import fully_shard_tp_model
from reference.data_parallel.gradient_shards import ShardedGradBucket, ShardedGradOptimizer
from reference.data_parallel.mixed_precision import unsharded
from reference.data_parallel.wrapper import DEFAULT_BUCKET_SIZE
from reference.fsdp.wrapper import MixedPrecision
from reference.fsdp2 import MixedPrecisionPolicy
from reference.gpt.model import GPT
from reference.gpt.parallelize import parallelize_gpt
from reference.gpt.train import data_parallel, fully_sharded
from reference.moe.layer import MoELayer
from reference.moe.parallelize import parallelize_moe
from reference.parallel_state import ParallelConfigError, ParallelLayout
from reference.recompute import check_mode, set_recompute

# The DP form by its ZeRO stage (Rajbhandari et al. 2020): what each rank of dp x cp keeps 1/(dp cp) of.
DP_SHARDING = {
    "replicate": "nothing (ZeRO-0): DDP, gradients all-reduced in buckets",
    "optimizer": "the optimizer state (ZeRO-1): the distributed optimizer",
    "gradients": "the gradients and the optimizer state (ZeRO-2): each bucket keeps its reduced shard",
    "fsdp": "parameters, gradients and optimizer state (ZeRO-3): FSDP1's flat parameters",
    "fsdp2": "parameters, gradients and optimizer state (ZeRO-3): FSDP2's per-parameter shards",
}
FULLY_SHARDED = ("fsdp", "fsdp2")
SHARDED_OPTIMIZERS = {"optimizer": DistributedOptimizer, "gradients": ShardedGradOptimizer}  # ZeRO-1, ZeRO-2


@dataclasses.dataclass(frozen=True)
class ParallelizeConfig:
    """What parallelize applies besides the layout's sizes. `bf16`: bf16 compute; over DDP the parameters are
    bf16 and the gradients fp32 main grads, under FSDP the shards stay fp32 (FSDP's mixed precision)."""

    sequence_parallel: bool = False
    async_grad_allreduce: bool = True
    seed: int = 1234  # the TP dropout stream's
    recompute: str = "none"
    dp_sharding: str = "replicate"
    bucket_size: int | None = DEFAULT_BUCKET_SIZE
    overlap_grad_reduce: bool = True
    bf16: bool = False

    def __post_init__(self) -> None:
        if self.dp_sharding not in DP_SHARDING:
            raise ParallelConfigError(f"unknown DP form {self.dp_sharding!r}; choose one of {', '.join(DP_SHARDING)}")
        check_mode(self.recompute)

    @property
    def fully_sharded(self) -> bool:
        return self.dp_sharding in FULLY_SHARDED


def parallelize(
    model: GPT | list[GPT],
    layout: ParallelLayout,
    config: ParallelizeConfig,
    observe: Callable[[list[nn.Module]], object] | None = None,
) -> nn.Module | list[nn.Module]:
    """`model` (this rank's stage, or its interleaved chunks) split over the layout's TP and EP groups,
    recomputing as asked, then wrapped for its DP form; returns the module (or list) to train. `observe`
    sees the split chunks before the DP wrapper renames and reshards them (a recorder names modules there).
    A collective."""
    chunks = model if isinstance(model, list) else [model]
    if config.fully_sharded and len(chunks) > 1:
        raise ParallelConfigError(f"--dp-sharding {config.dp_sharding} trains one model chunk per stage")
    if config.fully_sharded and layout.size("cp") > 1:
        raise ParallelConfigError(f"--dp-sharding {config.dp_sharding} shards over dp alone: use --cp 1 with it")
    for chunk in chunks:
        parallelize_gpt(
            chunk,
            layout.tp_group,
            sequence_parallel=config.sequence_parallel,
            seed=config.seed,
            async_grad_allreduce=config.async_grad_allreduce,
        )
        for layer in [m for m in chunk.modules() if isinstance(m, MoELayer)]:
            parallelize_moe(layer, layout)
        parallelize_context(chunk, layout)
        for block in chunk.layers:
            set_recompute(block, config.recompute)
    if observe is not None:
        observe(chunks)
    wrapped = [_data_parallel(chunk, layout, config) for chunk in chunks]
    return wrapped if isinstance(model, list) else wrapped[0]


def _data_parallel(model: GPT, layout: ParallelLayout, config: ParallelizeConfig) -> nn.Module:
    """The DP form: DDP buckets (replicate; reduce-scattered for the distributed optimizer, each keeping only its
    gradient shard for ZeRO-2), or FSDP1/FSDP2 over the DP group, TP inside."""
    if config.dp_sharding == "fsdp":
        precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if config.bf16 else None
        return fully_sharded(model, layout, mixed_precision=precision)
    if config.dp_sharding == "fsdp2":
        bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if config.bf16 else {}
        return fully_shard_tp_model(model, layout, mp_policy=MixedPrecisionPolicy(**bf16))
    return data_parallel(
        model,
        layout,
        bucket_size=config.bucket_size,
        overlap_grad_reduce=config.overlap_grad_reduce,
        use_distributed_optimizer=config.dp_sharding in SHARDED_OPTIMIZERS,
        bucket_class=ShardedGradBucket if config.dp_sharding == "gradients" else GradBucket,
        grad_dtype=torch.float32 if config.bf16 else None,  # bf16 parameters: Megatron's fp32 main grads
    )


def build_optimizer(model, config: ParallelizeConfig, make_optimizer) -> torch.optim.Optimizer:
    """The optimizer for the DP form: FSDP's fp32 shards step directly (its own master weights); over DDP fp32
    masters of bf16 parameters (the fp32 ones step in place) as Megatron's optimizers, sharded over DP for ZeRO-1
    and ZeRO-2.
    `make_optimizer(tensors)` builds the torch optimizer."""
    if config.fully_sharded:
        return make_optimizer(list(model.parameters()))
    return SHARDED_OPTIMIZERS.get(config.dp_sharding, unsharded)(model, make_optimizer)

"""The distributed optimizer (ZeRO stage 1): optimizer states and fp32 master weights sharded over the DP group.

Each bucket of the DDP wrapper is cut into dp equal slices; rank r reduce-scatters the bucket's fp32 gradients
(receiving the mean of slice r), steps the fp32 masters and Adam states of slice r only, and all-gathers the
updated bf16 parameters. A slice is cut by position, not at parameter boundaries: Adam is elementwise.

Mirrors `megatron-lm:megatron/core/optimizer/distrib_optimizer.py::DistributedOptimizer._build_model_gbuf_range`
and `megatron-lm:megatron/core/optimizer/distrib_optimizer.py::DistributedOptimizer.step_with_ready_grads`.
The bytes per rank and the traffic against DDP's are on the site's page on this module
(notes/reference/data_parallel.distributed_optimizer.md).
"""

from __future__ import annotations

from reference.data_parallel.mixed_precision import MasterWeightOptimizer, ModelChunks, OptimizerFactory, model_chunks


class DistributedOptimizer(MasterWeightOptimizer):
    """Steps this rank's slice of every bucket of `model` (one DDP model or its chunks), then all-gathers the
    parameters.

    Mirrors
    `megatron-lm:megatron/core/optimizer/distrib_optimizer.py::DistributedOptimizer._build_model_gbuf_range`,
    `megatron-lm:megatron/core/optimizer/distrib_optimizer.py::DistributedOptimizer._build_model_and_main_param_groups`.
    """

    def __init__(self, model: ModelChunks, make_optimizer: OptimizerFactory) -> None:
        self.chunks = model_chunks(model)
        if not all(chunk.use_distributed_optimizer for chunk in self.chunks):
            raise ValueError(
                "DistributedOptimizer needs a model wrapped with "
                "DistributedDataParallel(..., use_distributed_optimizer=True)"
            )
        super().__init__(
            [
                (params.shard, grads.shard)
                for chunk in self.chunks
                for params, grads in zip(chunk.param_buckets, chunk.buckets)
            ],
            make_optimizer,
        )

    def step(self) -> None:
        """Step the slices (their gradients were reduce-scattered by finish_grad_sync), then gather.

        Mirrors
        `megatron-lm:megatron/core/optimizer/distrib_optimizer.py::DistributedOptimizer.step_with_ready_grads`.
        """
        super().step()
        for chunk in self.chunks:
            chunk.start_param_sync()


def bytes_per_rank(model: ModelChunks, optimizer: MasterWeightOptimizer) -> dict[str, int]:
    """What this rank holds, in bytes: model parameters, gradient buckets, fp32 masters, optimizer states."""
    chunks = model_chunks(model)
    params = sum(
        sum(bucket.nbytes for bucket in chunk.param_buckets)
        if chunk.param_buckets
        else sum(p.numel() * p.element_size() for p in chunk.module.parameters() if p.requires_grad)
        for chunk in chunks
    )
    return {
        "parameters": params,
        "gradients": sum(bucket.nbytes for chunk in chunks for bucket in chunk.buckets),
        **optimizer.state_bytes(),
    }

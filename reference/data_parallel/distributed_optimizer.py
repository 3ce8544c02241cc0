"""The distributed optimizer (ZeRO stage 1): optimizer states and fp32 master weights sharded over the DP group.

With plain DDP every DP rank all-reduces the whole gradient and steps the whole model: dp identical copies of
the fp32 masters and Adam's two moments, 12 bytes per parameter each. Here each bucket of the DDP wrapper
(reference.data_parallel.wrapper with `use_distributed_optimizer=True`) is cut into dp equal slices; rank r

  1. reduce-scatters the bucket's fp32 gradients (issued as the bucket fills, overlapped with backward):
     it receives the DP mean of slice r only;
  2. steps slice r: fp32 masters and Adam states for 1/dp of the parameters
     (reference.data_parallel.mixed_precision.MasterWeightOptimizer over the slices);
  3. writes the updated slice, rounded to bf16, into its bucket's parameter buffer and all-gathers the buffer
     (reference.data_parallel.param_buckets), now or overlapped with the next forward.

Per rank: 2 bytes of bf16 parameters and 4 of fp32 gradients per parameter, plus 12/dp of optimizer state
(`bytes_per_rank`); the ZeRO paper's 2 + 2 + 12/N counts fp16 gradients. Traffic: a reduce-scatter and an
all-gather each move (dp-1)/dp of a buffer per rank, an all-reduce twice that; with fp32 gradients and bf16
parameters that is 4 + 2 = 6 bytes per parameter against DDP's 2 x 4 = 8 (with bf16 gradients, equal).

A slice is cut by position in the bucket, not by parameter: it may start and end inside a parameter. Adam is
elementwise, so stepping slices equals stepping whole parameters element for element. Megatron instead splits
each slice at parameter boundaries (`_build_model_gbuf_param_range_map`) so that parameters can sit in param
groups with different weight decay; this reference uses one group, so a slice per bucket is enough.

Counterparts: megatron/core/optimizer/distrib_optimizer.py::DistributedOptimizer (`_build_model_gbuf_range`:
rank r owns [r, r+1) x bucket size / dp of each bucket; `_build_model_and_main_param_groups`: fp32 main params
cloned from the bf16 shard; `_copy_model_grads_to_main_grads`, `_copy_main_params_to_model_params`,
`step_with_ready_grads`: start_param_sync unless overlap_param_gather).
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

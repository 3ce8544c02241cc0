"""ZeRO stage 2: the distributed optimizer, and each rank keeps only its shard of the reduced gradients.

Buckets accumulate (under `no_sync`) and reduce-scatter once a step as under ZeRO-1. When the optimizer step
begins, each bucket copies its reduced shard aside and frees its full buffer, which the next step's first
gradient allocates again: parameters whole, 2Ψ + (2 + 12)Ψ/N_d bytes per rank with bf16 gradients and Adam.
Megatron-core has no ZeRO-2. The site's page on this module (notes/reference/data_parallel.gradient_shards.md)
says why the buffer is freed at the step and how micro-batches accumulate.

Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_reduce_grad` (the unsharded gradient is dropped,
its shard kept) and `pytorch:torch/distributed/fsdp/_runtime_utils.py::_get_reduce_scatter_tensors`.
"""

from __future__ import annotations

import torch

from reference.data_parallel.buckets import GradBucket
from reference.data_parallel.distributed_optimizer import DistributedOptimizer
from reference.data_parallel.mixed_precision import ModelChunks, OptimizerFactory


class ShardedGradBucket(GradBucket):
    """A reduce-scattered GradBucket whose full buffer lives from a step's first gradient to its optimizer step;
    `kept` is this rank's reduced shard, the one gradient tensor it holds between steps."""

    def __init__(self, params: list[torch.nn.Parameter], group, *, grad_dtype=None, sharded: bool = True) -> None:
        if not sharded:
            raise ValueError(
                "ShardedGradBucket keeps a shard of a reduce-scattered bucket: needs "
                "DistributedDataParallel(..., use_distributed_optimizer=True)"
            )
        super().__init__(params, group, grad_dtype=grad_dtype, sharded=True)
        self.kept = torch.zeros_like(self.shard)
        self.release()

    @property
    def freed(self) -> bool:
        return self.grad_data.untyped_storage().size() == 0

    @property
    def shard(self) -> torch.Tensor:
        """The reduced shard: a view of the full buffer while it is allocated, else the kept copy."""
        return self.kept if self.freed else super().shard

    @property
    def nbytes(self) -> int:
        """Bytes held now: the kept shard, and the full buffer while it is allocated."""
        return self.grad_data.untyped_storage().nbytes() + self.kept.nbytes

    @torch.no_grad()
    def release(self) -> None:
        """Keep the reduced shard, free the full buffer (its views stay, storage-less; `.grad` views are dropped).

        Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_reduce_grad`.
        """
        if self.freed:
            return
        self.kept.copy_(self.shard)
        self.grad_data.untyped_storage().resize_(0)
        if not self.main_grad:  # autograd would accumulate into a storage-less .grad
            for param in self.params:
                param.grad = None

    def allocate(self) -> None:
        """The full buffer back, zeroed (its views find their storage again)."""
        if self.freed:
            self.grad_data.untyped_storage().resize_(self.grad_data.numel() * self.grad_data.element_size())
            self.grad_data.zero_()

    def take_grad(self, param: torch.nn.Parameter) -> None:
        """The step's first gradient allocates the full buffer; then as GradBucket."""
        self.allocate()
        super().take_grad(param)

    def start_grad_sync(self, async_op: bool) -> None:
        """As GradBucket's; a bucket no gradient reached this step reduce-scatters zeros."""
        self.allocate()
        super().start_grad_sync(async_op)

    def zero(self) -> None:
        self.kept.zero_()
        if not self.freed:
            super().zero()


class ShardedGradOptimizer(DistributedOptimizer):
    """The distributed optimizer over ShardedGradBuckets: each step first releases every bucket, then steps the
    kept shards (DistributedDataParallel(..., use_distributed_optimizer=True, bucket_class=ShardedGradBucket))."""

    def __init__(self, model: ModelChunks, make_optimizer: OptimizerFactory) -> None:
        super().__init__(model, make_optimizer)
        self.buckets = [bucket for chunk in self.chunks for bucket in chunk.buckets]
        if not all(isinstance(bucket, ShardedGradBucket) for bucket in self.buckets):
            raise ValueError(
                "ShardedGradOptimizer needs a model wrapped with "
                "DistributedDataParallel(..., use_distributed_optimizer=True, bucket_class=ShardedGradBucket)"
            )
        self.grads = [bucket.kept for bucket in self.buckets]

    def step(self) -> None:
        for bucket in self.buckets:
            bucket.release()
        super().step()

"""Data parallelism: every DP rank holds the same parameters, runs its own slice of the batch, and the
gradients are averaged over the DP group before the optimizer step.

`DistributedDataParallel(module, dp_group, bucket_size=..., overlap_grad_reduce=True)` issues each bucket's
all-reduce as soon as its last gradient is ready, strictly in bucket order; `no_sync()` lets micro-batches
accumulate without communication and `finish_grad_sync()` waits. With TP, `dp_group` holds the ranks with the
same shards. Mirrors
`megatron-lm:megatron/core/distributed/distributed_data_parallel.py::DistributedDataParallel._make_backward_post_hook`
and `pytorch:torch/nn/parallel/distributed.py::DistributedDataParallel.no_sync`. The site's page on this module
(notes/reference/data_parallel.wrapper.md) covers mixed precision and the distributed optimizer's options.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from reference.data_parallel.buckets import GradBucket, bucket_layout
from reference.data_parallel.param_buckets import ParamBucket
from reference.parallel_state import divide
from reference.tensor_parallel import deferred_wgrad

DEFAULT_BUCKET_SIZE = 25 * 2**20  # bytes, torch DDP's bucket_cap_mb default


class DistributedDataParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        bucket_size: int | None = DEFAULT_BUCKET_SIZE,
        overlap_grad_reduce: bool = True,
        broadcast_params: bool = True,
        grad_dtype: torch.dtype | None = None,
        use_distributed_optimizer: bool = False,
        overlap_param_gather: bool = False,
        bucket_class: type[GradBucket] = GradBucket,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("DistributedDataParallel needs torch.distributed.init_process_group() first")
        self.module = module
        self.process_group = process_group or dist.group.WORLD
        self.overlap_grad_reduce = overlap_grad_reduce
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for name, param in named:
            if hasattr(param, "main_grad"):
                raise ValueError(
                    f"parameter '{name}' accumulates into main_grad (gradient_accumulation_fusion); "
                    "reference DDP reduces .grad: build the model with gradient_accumulation_fusion=False"
                )
        params = [p for _, p in named]
        if overlap_param_gather and not use_distributed_optimizer:
            raise ValueError(
                "overlap_param_gather needs use_distributed_optimizer=True: only the distributed "
                "optimizer all-gathers parameters"
            )
        self.use_distributed_optimizer = use_distributed_optimizer
        self.buckets = [
            bucket_class(
                [params[i] for i in indices],
                self.process_group,
                grad_dtype=grad_dtype,
                sharded=use_distributed_optimizer,
            )
            for indices in bucket_layout(params, bucket_size)
        ]
        self._bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}
        self.param_buckets = (
            [
                ParamBucket(bucket.params, bucket.grad_data.numel(), self.process_group, overlap_param_gather)
                for bucket in self.buckets
            ]
            if use_distributed_optimizer
            else []
        )
        self._hooks_pre = ParamBucket.wait_before_forward(module, self.param_buckets) if overlap_param_gather else []
        self._next_bucket = 0
        self._sync = True
        if broadcast_params:
            self.broadcast_params()
        self._hooks = [param.register_post_accumulate_grad_hook(self._grad_ready) for param in params]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Copy the DP group's first rank's parameters to the others, one bucket at a time, so the replicas
        start equal (torch: `_sync_module_states`; megatron: `broadcast_params`)."""
        source = dist.get_global_rank(self.process_group, 0)
        for bucket in self.buckets:
            flat = torch.cat([p.detach().reshape(-1) for p in bucket.params])
            dist.broadcast(flat, src=source, group=self.process_group)
            for param, piece in zip(bucket.params, flat.split([p.numel() for p in bucket.params])):
                param.copy_(piece.view_as(param))

    def remove_hooks(self) -> None:
        """Detach this wrapper from its parameters (the hooks hold it alive, and would keep moving gradients
        into its buckets), e.g. before wrapping the same module again."""
        for handle in self._hooks + self._hooks_pre:
            handle.remove()
        self._hooks, self._hooks_pre = [], []

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook (megatron: `_make_backward_post_hook` -> `register_grad_ready`, which
        too only counts gradients when overlapping: without overlap finish_grad_sync issues every bucket).

        Mirrors
        `megatron-lm:megatron/core/distributed/distributed_data_parallel.py::DistributedDataParallel._make_backward_post_hook`.
        """
        if deferred_wgrad.left_for_later(param):  # a zero-bubble I: this gradient arrives with its W
            return
        bucket = self._bucket_of[param]
        bucket.take_grad(param)
        if self._sync and self.overlap_grad_reduce and bucket.mark_ready(param):
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Issue, in bucket order, every complete bucket not issued yet; stop at the first incomplete one."""
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if len(bucket.ready) < len(bucket.params):
                return
            bucket.start_grad_sync(async_op=True)
            self._next_bucket += 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication (megatron's config.no_sync_func).

        Mirrors `megatron-lm:megatron/core/distributed/distributed_data_parallel.py::DistributedDataParallel.no_sync`
        and `pytorch:torch/nn/parallel/distributed.py::DistributedDataParallel.no_sync`.
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's all-reduce (issuing those not issued yet, in order); afterwards each
        `.grad` holds the mean over the DP group of the gradients accumulated since the last zero_grad.

        Mirrors
        `megatron-lm:megatron/core/distributed/distributed_data_parallel.py::DistributedDataParallel.finish_grad_sync`.
        """
        for bucket in self.buckets:
            bucket.finish_grad_sync()
        self._next_bucket = 0

    def start_param_sync(self) -> None:
        """Distributed optimizer: all-gather every bucket's updated parameters (issued now and waited, or,
        with overlap_param_gather, left for the next forward's pre-hooks; megatron's `start_param_sync`)."""
        for bucket in self.param_buckets:
            bucket.start_param_sync()
        if self.param_buckets:  # overlapped: the first bucket the forward needs goes on the wire now
            self.param_buckets[-1].issue()

    def finish_param_sync(self) -> None:
        """Wait for every pending parameter all-gather (before reading the parameters outside a forward)."""
        for bucket in reversed(self.param_buckets):
            bucket.finish_param_sync()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the bucket buffers, keeping `.grad` as views into them (`set_to_none` is ignored: the
        buffers are the gradients' storage, as with megatron's `zero_grad_buffer`)."""
        for bucket in self.buckets:
            bucket.zero()


def local_batch(batch: torch.Tensor, group: dist.ProcessGroup, dim: int = 0) -> torch.Tensor:
    """This rank's contiguous 1/dp slice of a global batch along `dim` (refuses sizes dp does not divide)."""
    per_rank = divide(batch.shape[dim], group.size(), "the global batch size", by="the data-parallel size")
    return batch.narrow(dim, dist.get_rank(group) * per_rank, per_rank)

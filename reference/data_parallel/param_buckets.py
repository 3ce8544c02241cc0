"""Parameter buckets for the distributed optimizer: a bucket's parameters live in one flat buffer, and after the
optimizer step each rank all-gathers the others' updated shards into it.

Laid out exactly like its gradient bucket, a buffer takes one in-place `all_gather_into_tensor` whose input is
this rank's slice; every parameter is a view into it, so nothing is copied. With `overlap_param_gather` the
next forward waits for each bucket in a pre-hook and issues the one it needs next.

Mirrors `megatron-lm:megatron/core/distributed/param_and_grad_buffer.py::_ParamAndGradBucketGroup.start_param_sync`
and `megatron-lm:megatron/core/distributed/distributed_data_parallel.py::DistributedDataParallel._make_forward_pre_hook`
(notes/reference/data_parallel.param_buckets.md says where the first all-gather is issued, and why).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from reference.distributed import all_gather_single


class ParamBucket:
    """One bucket's parameters as views into a flat buffer of `numel` elements (padded like its gradients)."""

    def __init__(self, params: list[nn.Parameter], numel: int, group: dist.ProcessGroup, overlap: bool) -> None:
        self.params, self.group, self.overlap = params, group, overlap
        self.param_data = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        with torch.no_grad():
            for param in params:
                view = self.param_data[offset : offset + param.numel()].view(param.shape)
                view.copy_(param)
                param.data = view
                offset += param.numel()
        self.work: dist.Work | None = None
        self.pending = False  # updated on some rank, not gathered here yet
        self.next: ParamBucket | None = None  # the bucket the forward needs after this one

    @property
    def nbytes(self) -> int:
        return self.param_data.numel() * self.param_data.element_size()

    @property
    def shard(self) -> torch.Tensor:
        """This rank's 1/dp of the buffer: the parameters its optimizer shard updates."""
        size = self.param_data.numel() // self.group.size()
        return self.param_data[self.group.rank() * size : (self.group.rank() + 1) * size]

    def start_param_sync(self) -> None:
        """After the step: gather now (and wait), or, overlapped, mark pending for the next forward."""
        if self.group.size() == 1:
            return
        self.pending = True
        if not self.overlap:
            self.finish_param_sync()

    def issue(self) -> None:
        """Put this bucket's pending all-gather on the wire (once).

        Mirrors
        `megatron-lm:megatron/core/distributed/param_and_grad_buffer.py::_ParamAndGradBucketGroup.start_param_sync`.
        """
        if self.pending and self.work is None:
            self.work = all_gather_single(self.param_data, self.shard, group=self.group, async_op=True)

    def finish_param_sync(self) -> None:
        """Wait for this bucket's all-gather (issuing it if nothing did), then issue the next one.

        Mirrors
        `megatron-lm:megatron/core/distributed/param_and_grad_buffer.py::_ParamAndGradBucketGroup.finish_param_sync`.
        """
        if not self.pending:
            return
        self.issue()
        self.work.wait()
        self.work, self.pending = None, False
        if self.overlap and self.next is not None:
            self.next.issue()

    @staticmethod
    def wait_before_forward(module: nn.Module, buckets: list[ParamBucket]) -> list:
        """Forward pre-hooks: a module waits for the buckets of its own parameters. Chains the buckets in the
        order the forward needs them (last bucket first) so each wait prefetches the next one.

        Mirrors
        `megatron-lm:megatron/core/distributed/distributed_data_parallel.py::DistributedDataParallel._make_forward_pre_hook`.
        """
        for later, earlier in zip(buckets[1:], buckets[:-1]):
            later.next = earlier
        bucket_of = {param: bucket for bucket in buckets for param in bucket.params}

        def hook(mod: nn.Module, _inputs) -> None:
            for param in mod.parameters(recurse=False):
                if param in bucket_of:
                    bucket_of[param].finish_param_sync()

        return [
            m.register_forward_pre_hook(hook)
            for m in module.modules()
            if any(p in bucket_of for p in m.parameters(recurse=False))
        ]

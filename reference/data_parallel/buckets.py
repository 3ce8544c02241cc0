"""Gradient buckets: the gradients of many parameters packed into one flat buffer, all-reduced in one call.

Buckets of about `bucket_size` bytes are filled in reverse parameter order, roughly the order backward produces
gradients, so the last layers' bucket is on the wire while earlier layers still differentiate. Under mixed
precision the buffer is an fp32 `main_grad`; under the distributed optimizer it is reduce-scattered.

Mirrors `megatron-lm:megatron/core/distributed/param_and_grad_buffer.py::_ParamAndGradBuffer` and
`megatron-lm:megatron/core/distributed/param_and_grad_buffer.py::_ParamAndGradBucketGroup.start_grad_sync`
(torch's Reducer closes buckets by the same rule). The site's page on this module
(notes/reference/data_parallel.buckets.md) gives the closing rule, the units and the padding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference.distributed import reduce_scatter_single


def bucket_layout(params: list[torch.Tensor], bucket_size: int | None) -> list[list[int]]:
    """Indices into `params` of each bucket, in reduction order: walk the parameters from last to first,
    add each to the open bucket, close it once it holds >= bucket_size bytes (None: one bucket).

    Mirrors `megatron-lm:megatron/core/distributed/param_and_grad_buffer.py::_ParamAndGradBuffer`.
    """
    if bucket_size is not None and bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of bytes or None (one bucket), got {bucket_size}")
    buckets: list[list[int]] = []
    current: list[int] = []
    nbytes = 0
    for index in reversed(range(len(params))):
        if current and params[index].dtype != params[current[0]].dtype:
            buckets.append(current)
            current, nbytes = [], 0
        current.append(index)
        nbytes += params[index].numel() * params[index].element_size()
        if bucket_size is not None and nbytes >= bucket_size:
            buckets.append(current)
            current, nbytes = [], 0
    return buckets + [current] if current else buckets


def padded_numel(numel: int, group_size: int) -> int:
    """`numel` rounded up to a multiple of the group size, so that every rank's shard has the same size."""
    return -(-numel // group_size) * group_size


class GradBucket:
    """One flat gradient buffer, its parameters' gradient views into it, and its reduction in flight.

    grad_dtype: None keeps `.grad` views of the parameters' dtype; a dtype keeps `main_grad` views of it.
    sharded: pad to a multiple of the group size and reduce-scatter (see the module docstring)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group: dist.ProcessGroup,
        *,
        grad_dtype: torch.dtype | None = None,
        sharded: bool = False,
    ) -> None:
        self.params, self.group, self.sharded = params, group, sharded
        self.numel = sum(p.numel() for p in params)
        self.main_grad = grad_dtype is not None
        self.grad_data = torch.zeros(
            padded_numel(self.numel, group.size()) if sharded else self.numel,
            dtype=grad_dtype or params[0].dtype,
            device=params[0].device,
        )
        self.views: dict[torch.nn.Parameter, torch.Tensor] = {}
        offset = 0
        for param in params:
            self.views[param] = self.grad_data[offset : offset + param.numel()].view(param.shape)
            offset += param.numel()
        self.ready: set[torch.nn.Parameter] = set()
        self.work: dist.Work | None = None
        self.started = False
        self.attach_grads()

    @property
    def nbytes(self) -> int:
        return self.grad_data.numel() * self.grad_data.element_size()

    @property
    def shard(self) -> torch.Tensor:
        """This rank's 1/dp of the (padded) buffer: after a sharded sync, the mean gradient it steps."""
        size = self.grad_data.numel() // self.group.size()
        return self.grad_data[self.group.rank() * size : (self.group.rank() + 1) * size]

    def attach_grads(self) -> None:
        """Point every parameter's `.grad` (or `main_grad`) at its view, so gradients land in the bucket."""
        for param, view in self.views.items():
            if self.main_grad:
                param.main_grad = view
            else:
                param.grad = view

    def take_grad(self, param: torch.nn.Parameter) -> None:
        """After autograd wrote `param.grad`: with main_grad, add it into the view and drop it (fp32
        accumulation); otherwise, if it is not the bucket view (the optimizer set it to None, so autograd
        allocated a fresh one), move it into the view; the view is the gradient from now on.

        Mirrors
        `megatron-lm:megatron/core/distributed/distributed_data_parallel.py::DistributedDataParallel._make_backward_post_hook`.
        """
        view = self.views[param]
        if self.main_grad:
            view.add_(param.grad)
            param.grad = None
        elif param.grad is not view:
            view.copy_(param.grad)
            param.grad = view

    def mark_ready(self, param: torch.nn.Parameter) -> bool:
        """Record that `param`'s gradient is final for this step; True once the whole bucket is.

        A second gradient for the same parameter in one synced step means a backward ran outside no_sync
        after the bucket may already be on the wire: its all-reduce would miss that gradient, or race with
        it. Refused, as megatron's _ParamAndGradBucketGroup.register_grad_ready ("Cannot set grad twice")."""
        if param in self.ready:
            raise RuntimeError(
                "DistributedDataParallel: a parameter's gradient arrived twice in one synced step; "
                "run every backward but the last of a step under no_sync()"
            )
        self.ready.add(param)
        return len(self.ready) == len(self.params)

    def start_grad_sync(self, async_op: bool) -> None:
        """Scale by 1/dp, then all-reduce (sum): the data-parallel mean, as both upstreams (scaling first
        keeps low-precision sums in range; at a power-of-two dp size the order does not change a bit).

        Mirrors
        `megatron-lm:megatron/core/distributed/param_and_grad_buffer.py::_ParamAndGradBucketGroup.start_grad_sync`.
        """
        if self.group.size() > 1:  # a replica of one: its gradient is already the mean
            self.grad_data.mul_(1.0 / self.group.size())
            if self.sharded:  # in place, as Megatron: the output is this rank's view of the input
                self.work = reduce_scatter_single(self.shard, self.grad_data, group=self.group, async_op=async_op)
            else:
                self.work = dist.all_reduce(self.grad_data, group=self.group, async_op=async_op)
        self.started = True

    def finish_grad_sync(self) -> None:
        """Wait for the all-reduce (issuing it now if nothing did) and reset for the next step.

        Mirrors
        `megatron-lm:megatron/core/distributed/param_and_grad_buffer.py::_ParamAndGradBucketGroup.finish_grad_sync`.
        """
        if not self.started:
            self.start_grad_sync(async_op=False)
        if self.work is not None:
            self.work.wait()
        self.work, self.started = None, False
        self.ready.clear()

    def zero(self) -> None:
        """Megatron's `zero_grad_buffer`: clear the gradients and re-attach the views."""
        self.grad_data.zero_()
        self.attach_grads()

"""Gradient buckets: the gradients of many parameters packed into one flat buffer, all-reduced in one call.

One all-reduce per parameter would pay the collective's latency hundreds of times; one for the whole
model could only start after the last gradient exists. Buckets of about `bucket_size` bytes are the middle
ground, and they are filled in *reverse* parameter order because that is roughly the order backward
produces gradients in: the bucket holding the last layers is complete first and can be on the wire while
earlier layers are still differentiating.

Counterparts:
  * megatron/core/distributed/param_and_grad_buffer.py::_ParamAndGradBuffer (builds the buckets: parameters
    in reverse order, a bucket closed once it holds at least `bucket_size` elements) and
    ::_ParamAndGradBucketGroup.start_grad_sync / finish_grad_sync (issue, then wait the all-reduce;
    `gradient_scaling_factor` = 1 / dp size applied to the bucket before it).
  * torch/csrc/distributed/c10d/reducer.cpp::compute_bucket_assignment_by_size (same closing rule with a
    byte limit, exposed as torch.distributed._compute_bucket_assignment_by_size) and Reducer's
    `gradient_as_bucket_view=True` (each parameter's `.grad` is a view into its bucket, no copy).
Here `bucket_size` is in bytes (torch's unit); a bucket also closes where the dtype changes (Megatron keeps
one buffer per dtype), so one buffer never mixes dtypes.

Mixed precision (`grad_dtype` wider than the parameters, e.g. bf16 parameters, fp32 gradients): the bucket's
buffer is Megatron's `main_grad`, not `.grad` (which must have the parameter's dtype). Autograd writes a bf16
`.grad`, the hook adds it into the fp32 `param.main_grad` view and drops it, as megatron's
distributed_data_parallel.py::DistributedDataParallel._make_backward_post_hook does; micro-batches accumulate in
fp32 and the buffer is reduced in fp32 (Megatron-LM's default for bf16, `grad_reduce_in_fp32=True`).

Sharded (the distributed optimizer, reference.data_parallel.distributed_optimizer): the buffer is padded to a
multiple of the DP size and *reduce-scattered* instead of all-reduced, in place: rank r keeps the mean of the
r-th 1/dp of the bucket (`shard`), which is all its optimizer shard needs
(param_and_grad_buffer.py::_ParamAndGradBucketGroup.start_grad_sync with use_distributed_optimizer; Megatron
pads further, to a multiple of lcm(dp, 128) elements, for GPU memory alignment, which the CPU does not need).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
                self.work = dist.reduce_scatter_tensor(self.shard, self.grad_data, group=self.group, async_op=async_op)
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

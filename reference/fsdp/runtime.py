"""The FSDP runtime: free functions over a unit's state, run from its forward and from autograd hooks.

Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_root_pre_forward` and the functions around it
(`pytorch:torch/distributed/fsdp/_runtime_utils.py::_pre_forward_unshard`,
`pytorch:torch/distributed/fsdp/_runtime_utils.py::_post_backward_hook`, ...) function for function: each
function here names its upstream twin. Two waits come later than upstream's on purpose (gloo has no streams to
overlap on), and every device all-gathers with `all_gather_single`; the site's page on this module
(notes/reference/fsdp.runtime.md) gives the table and the reasons.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_map

from reference.distributed import reduce_scatter_single
from reference.fsdp.flat_param import FlatParamHandle, HandleTrainingState
from reference.fsdp.prefetch import ExecutionOrder, PrefetchMode, handle_to_prefetch

Unit = nn.Module  # a reference.fsdp.wrapper.FullyShardedDataParallel: the wrapper imports this module, not back


@dataclass
class SharedState:
    """What every unit under one root shares (upstream: the root's `_exec_order_data`, `_all_fsdp_states`)."""

    units: list[Unit]
    exec_order: ExecutionOrder = field(default_factory=ExecutionOrder)
    pending_reductions: list = field(default_factory=list)
    post_backward_callback_queued: bool = False


def unshard(unit: Unit, handle: FlatParamHandle) -> None:
    """`_unshard`: issue the all-gather (no-op when the buffer is still allocated) without waiting."""
    handle.unshard()


def prefetch(unit: Unit, current: FlatParamHandle, mode: PrefetchMode) -> None:
    """`_prefetch_handle`: unshard the next unit early, emulating the state it will be unsharded in.

    Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_prefetch_handle`.
    """
    target = handle_to_prefetch(unit.shared.exec_order, current, unit.forward_prefetch, unit.backward_prefetch)
    if target is None:
        return
    previous = target.training_state
    target.training_state = (
        HandleTrainingState.FORWARD if mode == PrefetchMode.FORWARD else HandleTrainingState.BACKWARD_PRE
    )
    unshard(unit, target)
    target.training_state = previous
    target.prefetched = True


def reshard(handle: FlatParamHandle, free_unsharded: bool) -> None:
    """`_reshard`: after it, the handle must be unsharded again before use, so it is no longer prefetched.

    Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_reshard`.
    """
    handle.reshard(free_unsharded)
    handle.prefetched = False


def root_pre_forward(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`_root_pre_forward`: with forward prefetch every unit needs its pre-forward unshard again;
    floating-point inputs are cast to `param_dtype`.

    Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_root_pre_forward`.
    """
    if unit.forward_prefetch:
        for other in unit.shared.units:
            if other.handle is not None:
                other.handle.needs_pre_forward_unshard = True
                other.handle.prefetched = False
    return cast_floating(unit.param_dtype, args), cast_floating(unit.param_dtype, kwargs)


def pre_forward(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """All-gather this unit (unless prefetched), prefetch the next one, then wait for this one.

    Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_pre_forward_unshard`.
    """
    handle = unit.handle
    if handle is None:
        return args, kwargs
    unit.shared.exec_order.record_pre_forward(handle)
    handle.training_state = HandleTrainingState.FORWARD
    if not handle.prefetched:
        unshard(unit, handle)
    handle.needs_pre_forward_unshard = False
    prefetch(unit, handle, PrefetchMode.FORWARD)
    handle.wait_unshard()
    return args, kwargs


def post_forward(unit: Unit, output: Any) -> Any:
    """Reshard (the root keeps its parameters for the backward it is about to start), then hook the
    outputs so the backward re-gathers this unit before its gradient computation.

    Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_post_forward_reshard`.
    """
    handle = unit.handle
    if handle is None:
        return output
    unit.shared.exec_order.record_post_forward(handle)
    reshard(handle, free_unsharded=not unit.is_root)
    output = register_pre_backward(unit, handle, output)
    handle.training_state = HandleTrainingState.IDLE
    return output


def register_pre_backward(unit: Unit, handle: FlatParamHandle, output: Any) -> Any:
    """`_register_pre_backward_hooks`: a hook on every output tensor that requires grad; the first to
    fire runs `pre_backward_hook` for the unit.

    Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_register_pre_backward_hooks`.
    """
    if not torch.is_grad_enabled():
        return output
    handle.needs_pre_backward_unshard = False
    handle.ran_pre_backward_hook = False

    def hook_tensor(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(functools.partial(pre_backward_hook, unit, handle))
            handle.needs_pre_backward_unshard = True
        return t

    return tree_map(hook_tensor, output)


def pre_backward_hook(unit: Unit, handle: FlatParamHandle, grad: torch.Tensor) -> torch.Tensor:
    """Before the unit's gradient computation: re-gather it (unless prefetched); with BACKWARD_PRE, issue
    the next unit's all-gather now. The first unit to get here in a backward (the root, whose output the
    loss reads) queues the end-of-backward callback.

    Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_pre_backward_hook`.
    """
    if handle.ran_pre_backward_hook:
        return grad
    shared = unit.shared
    if not shared.post_backward_callback_queued:
        shared.post_backward_callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(post_backward_final, shared))
    handle.training_state = HandleTrainingState.BACKWARD_PRE
    if handle.needs_pre_backward_unshard and not handle.prefetched:
        unshard(unit, handle)
    handle.needs_pre_backward_unshard = False
    prefetch(unit, handle, PrefetchMode.BACKWARD)
    handle.wait_unshard()
    handle.ran_pre_backward_hook = True
    return grad


@torch.no_grad()
def post_backward_hook(unit: Unit, handle: FlatParamHandle, flat_param: torch.nn.Parameter) -> None:
    """After autograd accumulated the unit's unsharded gradient: free the unsharded parameters, with
    BACKWARD_POST prefetch the next unit, and reduce-scatter the gradient right away.

    Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_post_backward_hook`.
    """
    handle.training_state = HandleTrainingState.BACKWARD_POST
    unsharded_grad = flat_param.grad
    flat_param.grad = None
    reshard(handle, free_unsharded=True)
    prefetch(unit, handle, PrefetchMode.BACKWARD)
    reduce_grad(unit, handle, unsharded_grad)


def reduce_grad(unit: Unit, handle: FlatParamHandle, unsharded_grad: torch.Tensor) -> None:
    """Average and reduce-scatter the padded flat gradient in `reduce_dtype`; the sum of grad/N over
    ranks is the data-parallel mean. Waited (and cast to the shard's dtype) in `post_backward_final`.

    Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_reduce_grad`.
    """
    grad = unsharded_grad.to(unit.reduce_dtype or unsharded_grad.dtype)
    grad.div_(handle.world_size)
    sharded = torch.empty(handle.shard_numel, dtype=grad.dtype, device=grad.device)
    work = reduce_scatter_single(sharded, grad, group=handle.process_group, async_op=True)
    unit.shared.pending_reductions.append((handle, work, sharded))


def post_backward_final(shared: SharedState) -> None:
    """End of backward (queued on the autograd engine by the root): wait for the reduce-scatters, hand
    the reduced shards to the original parameters' `.grad`, reshard anything still unsharded, reset.

    Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_post_backward_final_callback`.
    """
    for handle, work, sharded in shared.pending_reductions:
        work.wait()
        grad = sharded.to(handle.flat_param.dtype)
        handle.use_sharded_grad_views(grad.cpu() if handle.offload_to_cpu else grad)
    shared.pending_reductions.clear()
    shared.exec_order.next_iter()
    for unit in shared.units:
        handle = unit.handle
        if handle is None:
            continue
        if handle.is_unsharded():  # `_catch_all_reshard`: used in forward, never reached in backward
            reshard(handle, free_unsharded=True)
        handle.ran_pre_backward_hook = False
        handle.needs_pre_backward_unshard = False
        handle.post_forward_index = None
        handle.training_state = HandleTrainingState.IDLE
        handle.prefetched = False
    shared.post_backward_callback_queued = False


def cast_floating(dtype: torch.dtype | None, tree: Any) -> Any:
    """`_root_cast_forward_input`: the root casts floating-point inputs to `param_dtype`."""
    if dtype is None:
        return tree
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)

"""The hooks of one `fully_shard`-ed module, and the root's once-per-iteration work.

A forward pre-hook unshards the module's group (and issues the explicit forward prefetches); a forward hook
reshards it and hooks the outputs so that backward unshards it again (and issues the explicit, or else the
implicit, backward prefetch). The first module to run forward becomes the root: it finds every state under
it (lazy init), keeps its own parameters unsharded after forward unless told otherwise, and queues the
end-of-backward callback that post-backwards what autograd did not reach and waits for every reduction.

Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_state.py::FSDPState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_map

from reference.fsdp2 import param_group
from reference.fsdp2.param_group import ParamGroup, TrainingState

STATE_ATTR = "_reference_fsdp2_state"


@dataclass
class StateContext:
    """What every state under one root shares.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_state.py::FSDPStateContext`.
    """

    all_states: list[FSDPState] = field(default_factory=list)
    iter_forward_root: FSDPState | None = None
    post_backward_final_callback_queued: bool = False


class FSDPState:
    def __init__(
        self,
        module: nn.Module,
        group: ParamGroup | None,
        param_dtype: torch.dtype | None,
        output_dtype: torch.dtype | None,
        cast_forward_inputs: bool,
        auto_reshard_after_forward: bool,
    ) -> None:
        self.module, self.group = module, group
        self.cast_dtype = param_dtype if cast_forward_inputs else None
        self.output_dtype = output_dtype
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.is_root: bool | None = None
        self.context = StateContext()
        self.training_state = TrainingState.IDLE
        self.states_to_forward_prefetch: list[FSDPState] = []
        self.states_to_backward_prefetch: list[FSDPState] = []
        module.__dict__[STATE_ATTR] = self
        # First pre-hook and last post-hook: the module computes between them with unsharded parameters.
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward, prepend=False)

    # -- forward ---------------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Root setup once per iteration, inputs cast to `param_dtype`, the group unsharded, then each
        explicit forward prefetch issued.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_state.py::FSDPState._pre_forward`.
        """
        self.training_state = TrainingState.FORWARD
        self._root_pre_forward()
        if self.cast_dtype is not None:
            args, kwargs = _cast_floating(self.cast_dtype, args), _cast_floating(self.cast_dtype, kwargs)
        if self.group is not None:
            args, kwargs = self.group.pre_forward(args, kwargs)
        for state in self.states_to_forward_prefetch:
            if state.group is not None:
                param_group.prefetch_unshard(state.group, "forward")
        return args, kwargs

    def _root_pre_forward(self) -> None:
        """Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_state.py::FSDPState._root_pre_forward`."""
        self._lazy_init()
        if self.context.iter_forward_root is None:
            self.context.iter_forward_root = self

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """Reshard, hook the outputs for the pre-backward, cast the outputs to `output_dtype`.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_state.py::FSDPState._post_forward`.
        """
        if self.group is not None:
            self.group.post_forward()
        output = self._register_pre_backward_hook(output)
        self.training_state = TrainingState.IDLE
        if self.context.iter_forward_root is self:
            self.context.iter_forward_root = None
        return _cast_floating(self.output_dtype, output) if self.output_dtype else output

    def _register_pre_backward_hook(self, output: Any) -> Any:
        """A hook on every output that requires grad: the first gradient to reach one runs `_pre_backward`.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_state.py::FSDPState._register_pre_backward_hook`.
        """
        if torch.is_grad_enabled():
            for t in torch.utils._pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    # -- backward --------------------------------------------------------------------------------------
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        """The first gradient to reach one of the module's outputs: unshard, then prefetch (explicitly the
        modules set by `set_modules_to_backward_prefetch`, else implicitly the one before in forward order).

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_state.py::FSDPState._pre_backward`.
        """
        self.training_state = TrainingState.PRE_BACKWARD
        if not self.context.post_backward_final_callback_queued:
            self.context.post_backward_final_callback_queued = True
            Variable._execution_engine.queue_callback(self._root_post_backward_final_callback)
        if self.group is not None:
            self.group.pre_backward(default_prefetch=not self.states_to_backward_prefetch)
        for state in self.states_to_backward_prefetch:
            if state.group is not None:
                param_group.prefetch_unshard(state.group, "backward")
        return grad

    def _root_post_backward_final_callback(self) -> None:
        """End of backward: post-backward every group autograd did not (a root fed token ids), then wait for
        every reduction and reset for the next iteration.

        Mirrors
        `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_state.py::FSDPState._root_post_backward_final_callback`.
        """
        for state in self.context.all_states:
            if state.group is not None:
                if state.group.training_state != TrainingState.POST_BACKWARD:
                    state.group.post_backward()
                state.group.training_state = TrainingState.IDLE
            state.training_state = TrainingState.IDLE
        for state in self.context.all_states:
            if state.group is not None:
                state.group.finalize_backward()
        if self.group is not None:
            self.group.comm.post_forward_order.clear()
        self.context.post_backward_final_callback_queued = False

    # -- lazy init -------------------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        """The first state to run forward is the root of every state under its module: they share its
        contexts, get their names, and the root keeps its parameters after forward (backward needs them first)
        unless `reshard_after_forward` was given.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_state.py::FSDPState._lazy_init`.
        """
        if self.is_root is not None:
            return
        self.is_root = True
        comm = self.group.comm if self.group is not None else param_group.CommContext()
        for name, module in self.module.named_modules():
            state = module.__dict__.get(STATE_ATTR)
            if state is None:
                continue
            if state is not self:
                if state.is_root is not None:
                    raise RuntimeError(f"'{name}' ran forward before its root: run forward through the root first")
                state.is_root = False
            state.context = self.context
            self.context.all_states.append(state)
            if state.group is not None:
                state.group.comm, state.group.name = comm, name
                for param in state.group.params:
                    param.fqn = f"{name}.{param.fqn}" if name else param.fqn
        if self.auto_reshard_after_forward and self.group is not None:
            self.group.post_forward_mesh = None


def _cast_floating(dtype: torch.dtype, tree: Any) -> Any:
    """Floating-point tensors of `tree` cast to `dtype`, as FSDP2's `_cast_fp_tensor` does to every input."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)

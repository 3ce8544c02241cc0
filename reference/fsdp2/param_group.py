"""A parameter group: the parameters one `fully_shard` call manages, all-gathered together and reduced together.

Its runtime, called from the module's hooks (reference/fsdp2/state.py): unshard (issue the all-gather),
wait_for_unshard (copy-out, then the module holds the unsharded parameters), reshard, the post-backward that
reduces the gradients, and the implicit backward prefetch: the group that ran forward just before this one is
all-gathered from this one's pre-backward. Only the group's own hooks issue its collectives, and
`prefetch_unshard` those issued early on another's behalf.

Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch
from torch import nn

from reference.fsdp2 import collectives
from reference.fsdp2.mesh import ShardMesh
from reference.fsdp2.param import ShardedParam, ShardedState


class TrainingState(Enum):
    """Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_common.py::TrainingState`."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


@dataclass
class CommContext:
    """What every group under one root shares: the post-forward order (reversed, the backward order) and the
    reductions issued in this backward, finished at its end.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPCommContext`.
    """

    post_forward_order: list[ParamGroup] = field(default_factory=list)
    pending_reduces: list[collectives.PendingReduce] = field(default_factory=list)


class ParamGroup:
    def __init__(
        self,
        params: list[tuple[str, nn.Module, str]],
        mesh: ShardMesh,
        post_forward_mesh: ShardMesh | None,
        device: torch.device,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
    ) -> None:
        """`post_forward_mesh`: None keeps the unsharded parameters from forward to backward, `mesh` reshards
        them, a smaller mesh keeps a shard on it (`reshard_after_forward` False, True, an int)."""
        self.params = [ShardedParam(fqn, module, name, mesh, device) for fqn, module, name in params]
        self.mesh, self.post_forward_mesh, self.device = mesh, post_forward_mesh, device
        self.name = ""  # the module's name from the root, set at lazy init ("" for the root)
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self.all_gather_result: collectives.AllGatherResult | None = None
        self.comm = CommContext()  # replaced by the root's at lazy init
        self.post_forward_indices: list[int] = []
        self.init_dtypes(param_dtype, reduce_dtype)

    def init_dtypes(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
        """Compute and all-gather in `param_dtype`, reduce in `reduce_dtype`, each defaulting to the one
        before it (the parameters' dtype, then `param_dtype`), as `MixedPrecisionPolicy` documents.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam.init_dtype_attrs`.
        """
        dtypes = {p.orig_dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"one parameter group needs one dtype (one flat buffer), found {sorted(map(str, dtypes))}")
        self.orig_dtype = dtypes.pop()
        self.param_dtype = param_dtype or self.orig_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        if self.reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"reduce_dtype must be float32 or bfloat16 (reduced by averaging), got {self.reduce_dtype}"
            )
        for param in self.params:
            param.param_dtype = self.param_dtype

    # -- unshard / reshard -----------------------------------------------------------------------------
    def unshard(self) -> None:
        """Issue the group's all-gather, unless one is pending or the group is unsharded already.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup.unshard`.
        """
        if self.all_gather_result is not None or self.sharded_state == ShardedState.UNSHARDED:
            return
        post_forward = self.sharded_state == ShardedState.SHARDED_POST_FORWARD
        group = (self.post_forward_mesh if post_forward else self.mesh).shard_group
        self.all_gather_result = collectives.foreach_all_gather(self.params, group, self.param_dtype, self.device)

    def wait_for_unshard(self) -> None:
        """Wait for the pending all-gather and copy it out; the modules then compute with unsharded parameters.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup.wait_for_unshard`.
        """
        if self.all_gather_result is None:
            return
        collectives.foreach_all_gather_copy_out(self.all_gather_result, self.params)
        self.all_gather_result = None
        for param in self.params:
            param.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """After forward as `reshard_after_forward` says; otherwise (after backward) back to the shards.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup.reshard`.
        """
        if self.training_state == TrainingState.FORWARD:
            if self.post_forward_mesh is None:
                return
            if self.post_forward_mesh is not self.mesh:
                for param in self.params:
                    param.to_sharded_post_forward(self.post_forward_mesh)
                self.sharded_state = ShardedState.SHARDED_POST_FORWARD
                return
        for param in self.params:
            param.to_sharded()
        self.sharded_state = ShardedState.SHARDED

    @contextlib.contextmanager
    def use_training_state(self, state: TrainingState):
        previous, self.training_state = self.training_state, state
        try:
            yield
        finally:
            self.training_state = previous

    # -- forward ---------------------------------------------------------------------------------------
    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """All-gather (a no-op if prefetched), wait, and route the inputs' gradients through the post-backward.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup.pre_forward`.
        """
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()
        return self._register_post_backward_hook(args, kwargs)

    def post_forward(self) -> None:
        """Reshard as configured and record this group's place in the forward order (for backward prefetch).

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup.post_forward`.
        """
        self.reshard()
        self.post_forward_indices.append(len(self.comm.post_forward_order))
        self.comm.post_forward_order.append(self)
        self.training_state = TrainingState.IDLE

    def _register_post_backward_hook(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Pass the inputs that require grad through `RegisterPostBackward`: when autograd has their gradients,
        the module's parameter gradients are complete, and `post_backward` runs. A module whose inputs need no
        gradient (the root, fed token ids) is post-backwarded by the end-of-backward callback instead.
        """
        if not torch.is_grad_enabled():
            return args, kwargs
        leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        where = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:
            return args, kwargs
        for i, t in zip(where, RegisterPostBackward.apply(self, *(leaves[i] for i in where))):
            leaves[i] = t
        return torch.utils._pytree.tree_unflatten(leaves, spec)

    # -- backward --------------------------------------------------------------------------------------
    def pre_backward(self, default_prefetch: bool) -> None:
        """Before the group's gradient computation: all-gather (a no-op if prefetched or never resharded),
        wait, and unless explicit prefetch was set, prefetch the group before it in forward order.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup.pre_backward`.
        """
        if self.training_state == TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        self.unshard()
        self.wait_for_unshard()
        if default_prefetch:
            self._backward_prefetch()

    def _backward_prefetch(self) -> None:
        """Implicit backward prefetch: the group whose forward finished just before this one's.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup._backward_prefetch`.
        """
        if not self.post_forward_indices:
            return
        index = self.post_forward_indices.pop()
        if index > 0:
            prefetch_unshard(self.comm.post_forward_order[index - 1], "backward")

    def post_backward(self) -> None:
        """Take the unsharded gradients, reshard, and issue their reduction (finished by `finalize_backward`).

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup.post_backward`.
        """
        self.training_state = TrainingState.POST_BACKWARD
        with_grads, grads = [], []
        if self.sharded_state == ShardedState.UNSHARDED:
            for param in self.params:
                grad = param.take_unsharded_grad()
                if grad is not None:
                    with_grads.append(param)
                    grads.append(grad)
        self.reshard()
        if grads:
            self.comm.pending_reduces.append(
                collectives.foreach_reduce(with_grads, grads, self.mesh, self.reduce_dtype)
            )

    def finalize_backward(self) -> None:
        """End of backward: wait for every pending reduction (in issue order) and set the sharded gradients.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup.finalize_backward`.
        """
        for pending in self.comm.pending_reduces:
            collectives.finish_reduce(pending)
        self.comm.pending_reduces.clear()
        self.post_forward_indices.clear()


def prefetch_unshard(target: ParamGroup, pass_type: str) -> None:
    """Issue `target`'s all-gather early, as if it were in the pass it is prefetched for.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup._prefetch_unshard`.
    """
    state = TrainingState.FORWARD if pass_type == "forward" else TrainingState.PRE_BACKWARD
    with target.use_training_state(state):
        target.unshard()


class RegisterPostBackward(torch.autograd.Function):
    """Identity on the module's inputs whose backward runs the group's `post_backward`.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::RegisterPostBackwardFunction`.
    """

    @staticmethod
    def forward(ctx: Any, group: ParamGroup, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.group.post_backward()
        return (None, *grads)

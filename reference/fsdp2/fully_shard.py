"""`fully_shard(module, mesh, reshard_after_forward=..., mp_policy=...)`: FSDP2's API over the reference.

Call it bottom-up (each layer, then the model): each call makes one parameter group of the module's parameters
that no earlier call took, shards each of them on dim 0, hooks the module, and changes the module's class to
one that also derives from `FSDPModule`, whose methods set the explicit prefetches and gather the full
parameters. The module stays where it was in the model; nothing wraps it. `mesh` is a `ShardMesh` (or a 1-D
or 2-D `DeviceMesh`, read the same way; default: shard over every rank).

Mirrors upstream `fully_shard` (see `fully_shard` below),
`pytorch:torch/distributed/fsdp/_fully_shard/_fully_shard.py::FSDPModule` and
`pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_api.py::MixedPrecisionPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from reference.distributed import all_gather_single
from reference.fsdp2.mesh import ShardMesh
from reference.fsdp2.param_group import ParamGroup
from reference.fsdp2.state import STATE_ATTR, FSDPState


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Unsharded parameters (so compute and the all-gather) in `param_dtype`, gradients reduced in
    `reduce_dtype` (default `param_dtype`), outputs cast to `output_dtype`, floating-point inputs cast to
    `param_dtype` when `cast_forward_inputs`; the shards the optimizer steps stay in their own dtype.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_api.py::MixedPrecisionPolicy`.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def fully_shard(
    module: nn.Module,
    mesh: ShardMesh | None = None,
    *,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
) -> nn.Module:
    """Shard `module`'s own parameters into one group and hook it; returns `module`, now an `FSDPModule`.
    `reshard_after_forward`: None (True, except False for the root), True, False, or the size of a smaller
    group (a divisor of the shard group's size) to keep the shards on between forward and backward.

    Mirrors upstream `fully_shard` (overloaded, so cited through what it calls):
    `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_init.py::_init_param_group` and
    `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_init.py::_apply_to_module`.
    """
    if module.__dict__.get(STATE_ATTR) is not None:
        raise ValueError(f"{type(module).__name__} is already fully_shard-ed; apply fully_shard once per module")
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed.init_process_group() first")
    mesh = _as_shard_mesh(mesh)
    params = _managed_params(module)
    group = None
    if params:
        device = getattr(params[0][1], params[0][2]).device
        post_forward = _post_forward_mesh(True if reshard_after_forward is None else reshard_after_forward, mesh)
        group = ParamGroup(params, mesh, post_forward, device, mp_policy.param_dtype, mp_policy.reduce_dtype)
    FSDPState(
        module,
        group,
        mp_policy.param_dtype,
        mp_policy.output_dtype,
        mp_policy.cast_forward_inputs,
        auto_reshard_after_forward=reshard_after_forward is None,
    )
    cls = module.__class__
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _no_deepcopy})
    module.__class__ = _FSDP_CLASSES[cls]
    return module


_FSDP_CLASSES: dict[type, type] = {}


def _no_deepcopy(*args, **kwargs):
    raise RuntimeError("a fully_shard-ed module cannot be deep-copied: copy the model before sharding it")


class FSDPModule:
    """Mixed into a `fully_shard`-ed module's class, ahead of its own.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fully_shard.py::FSDPModule`.
    """

    def _fsdp_state(self) -> FSDPState:
        return self.__dict__[STATE_ATTR]

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather `modules` right after this module's own all-gather in forward, in this order.

        Mirrors
        `pytorch:torch/distributed/fsdp/_fully_shard/_fully_shard.py::FSDPModule.set_modules_to_forward_prefetch`.
        """
        self._fsdp_state().states_to_forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather `modules` from this module's pre-backward instead of the implicit choice (the module
        before this one in forward order).

        Mirrors
        `pytorch:torch/distributed/fsdp/_fully_shard/_fully_shard.py::FSDPModule.set_modules_to_backward_prefetch`.
        """
        self._fsdp_state().states_to_backward_prefetch = [_state_of(m) for m in modules]

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change `reshard_after_forward` (e.g. True for the root, which keeps its parameters by default).

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fully_shard.py::FSDPModule.set_reshard_after_forward`.
        """
        for module in self.modules() if recurse else [self]:
            state = module.__dict__.get(STATE_ATTR)
            if state is not None and state.group is not None:
                state.auto_reshard_after_forward = False
                state.group.post_forward_mesh = _post_forward_mesh(reshard_after_forward, state.group.mesh)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter under this module, unsharded in its own dtype, by name (a collective over each
        group's shard group: call on every rank after a forward has named them), as `DTensor.full_tensor`."""
        full = {}
        for module in self.modules():
            state = module.__dict__.get(STATE_ATTR)
            for param in state.group.params if state is not None and state.group is not None else ():
                world = state.group.mesh.shard_size
                gathered = param.padded_shard.new_empty(param.shard_numel * world)
                all_gather_single(gathered, param.padded_shard, group=state.group.mesh.shard_group)
                full[param.fqn] = gathered[: param.orig_size.numel()].view(param.orig_size).cpu()
        return full


def _state_of(module) -> FSDPState:
    state = module.__dict__.get(STATE_ATTR) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(f"expected fully_shard-ed modules, got {type(module).__name__}")
    return state


def _as_shard_mesh(mesh) -> ShardMesh:
    if mesh is None:
        return ShardMesh.flat()
    if isinstance(mesh, ShardMesh):
        return mesh
    return ShardMesh.from_device_mesh(mesh)


def _post_forward_mesh(reshard_after_forward: bool | int, mesh: ShardMesh) -> ShardMesh | None:
    """None (keep unsharded), `mesh` (reshard), or the smaller mesh an int asks for.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_init.py::_get_post_forward_mesh_info`.
    """
    if isinstance(reshard_after_forward, bool):
        return mesh if reshard_after_forward else None
    if not isinstance(reshard_after_forward, int):
        raise ValueError(f"reshard_after_forward is a bool or an int, got {reshard_after_forward!r}")
    size = reshard_after_forward
    if size < 1 or mesh.shard_size % size:
        raise ValueError(f"reshard_after_forward={size}: expected a divisor of the shard group size {mesh.shard_size}")
    if size == 1:  # as upstream: resharding to one rank is keeping everything
        return None
    return mesh if size == mesh.shard_size else mesh.post_forward(size)


def _managed_params(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name in `module`, owner, attribute) of each parameter of `module` outside fully_shard-ed submodules,
    owners in post-order (children first), as upstream collects them; refuses a parameter reachable twice or
    already sharded by another group.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_init.py::_get_managed_modules`.
    """
    found: list[tuple[str, nn.Module, str]] = []
    seen: dict[int, str] = {}

    def visit(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            if child.__dict__.get(STATE_ATTR) is None:
                visit(f"{prefix}{name}.", child)
        for attr, param in mod._parameters.items():
            if param is None:
                continue
            fqn = f"{prefix}{attr}"
            if id(param) in seen or getattr(param, "_reference_fsdp2_sharded", False):
                raise ValueError(
                    f"parameter '{fqn}' is shared with '{seen.get(id(param), 'another fully_shard group')}': "
                    "put the modules sharing it under one fully_shard call"
                )
            seen[id(param)] = fqn
            found.append((fqn, mod, attr))

    visit("", module)
    for _, mod, attr in found:
        getattr(mod, attr)._reference_fsdp2_sharded = True
    return found

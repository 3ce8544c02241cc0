"""The unit wrapper, with FSDP1's constructor: `FullyShardedDataParallel(module, process_group, ...)`.

Wrap children before their parent, as with torch.distributed.fsdp.FullyShardedDataParallel (the demo swaps
the two with one flag): each wrap flattens the parameters of `module` that no already-wrapped child owns.
The outermost unit to run forward becomes the root (`pytorch:torch/distributed/fsdp/_runtime_utils.py::_lazy_init`),
which shares one execution order and one end-of-backward callback with every unit under it.

Always behaves like upstream's `use_orig_params=True`: `named_parameters()` yields the original names
(without the `_fsdp_wrapped_module.` prefix) and the original parameters, whose data is this rank's part of
the shard, so an optimizer built from `model.parameters()` steps on shards only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from reference.distributed import all_gather_single
from reference.fsdp import runtime
from reference.fsdp.flat_param import FlatParamHandle
from reference.fsdp.prefetch import BackwardPrefetch
from reference.fsdp.runtime import SharedState


@dataclass(frozen=True)
class MixedPrecision:
    """As `torch.distributed.fsdp.MixedPrecision`: compute/all-gather in `param_dtype`, reduce-scatter in
    `reduce_dtype` (defaults to `param_dtype` when only that is given, as upstream), buffers in
    `buffer_dtype`. The shards the optimizer updates stay in the parameters' original dtype.

    Mirrors `pytorch:torch/distributed/fsdp/api.py::MixedPrecision`.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class CPUOffload:
    """As `torch.distributed.fsdp.CPUOffload`: keep shards (and their gradients) on the CPU between uses.

    Mirrors `pytorch:torch/distributed/fsdp/api.py::CPUOffload`.
    """

    offload_params: bool = False


class FullyShardedDataParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch: bool = False,
        mixed_precision: MixedPrecision | None = None,
        cpu_offload: CPUOffload | None = None,
        device_id: torch.device | None = None,
    ) -> None:
        super().__init__()
        if isinstance(module, FullyShardedDataParallel) or getattr(module, "_reference_fsdp_wrapped", False):
            raise ValueError(f"{type(module).__name__} is already wrapped by reference FSDP; wrap each module once")
        if not dist.is_initialized():
            raise RuntimeError("FullyShardedDataParallel needs torch.distributed.init_process_group() first")
        params = _unowned_params(module)  # validates before anything is marked
        self._fsdp_wrapped_module = module
        module._reference_fsdp_wrapped = True
        self.process_group = process_group or dist.group.WORLD
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = backward_prefetch
        precision = mixed_precision or MixedPrecision()
        self.param_dtype = precision.param_dtype
        self.reduce_dtype = precision.reduce_dtype or precision.param_dtype
        self.is_root: bool | None = None
        self.shared: SharedState | None = None
        if precision.buffer_dtype is not None:
            for _, mod in _modules_outside_units(module, ""):
                for buffer_name, buffer in mod._buffers.items():
                    if buffer is not None and buffer.is_floating_point():
                        mod._buffers[buffer_name] = buffer.to(precision.buffer_dtype)
        self.handle: FlatParamHandle | None = None
        if params:
            device = device_id or getattr(params[0][1], params[0][2]).device
            offload = bool(cpu_offload and cpu_offload.offload_params)
            self.handle = FlatParamHandle(params, self.process_group, torch.device(device), self.param_dtype, offload)
            # Upstream hooks the flat parameter's AccumulateGrad node
            # (`pytorch:torch/distributed/fsdp/_runtime_utils.py::_register_post_backward_hook`); the
            # post-accumulate-grad hook fires at the same point.
            if self.handle.flat_param.requires_grad:  # a frozen unit is resharded by the final callback
                self.handle.flat_param.register_post_accumulate_grad_hook(self._post_backward_hook)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.shared is None:
            self._lazy_init()
        if self.is_root:
            args, kwargs = runtime.root_pre_forward(self, args, kwargs)
        args, kwargs = runtime.pre_forward(self, args, kwargs)
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return runtime.post_forward(self, output)

    def _post_backward_hook(self, flat_param: nn.Parameter) -> None:
        """runtime.post_backward_hook, looked up at each call (as FSDP1 calls its runtime through the module's
        globals), so that an observer can wrap it (reference.measure.fsdp_tracing)."""
        runtime.post_backward_hook(self, self.handle, flat_param)

    def _lazy_init(self) -> None:
        """This unit runs forward first, so it is the root of every unit inside it.

        Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_lazy_init`.
        """
        units = [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
        shared = SharedState(units)
        for name, unit in self.named_modules():
            if isinstance(unit, FullyShardedDataParallel):
                unit.shared, unit.is_root = shared, unit is self
                if unit.handle is not None:
                    unit.handle.name = clean_name(name) or "root"

    @property
    def module(self) -> nn.Module:
        """The wrapped module (upstream: `FullyShardedDataParallel.module`)."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        """Reach the wrapped module's attributes through the wrapper, as upstream does."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fsdp_wrapped_module, name)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        for name, param in super().named_parameters(*args, **kwargs):
            yield clean_name(name), param

    def handles(self) -> list[FlatParamHandle]:
        """Every unit's handle under this (root) unit, in module order."""
        return [m.handle for m in self.modules() if isinstance(m, FullyShardedDataParallel) and m.handle]

    def finish_grad_sync(self) -> None:
        """What finalize_model_grads asks of every model chunk, DDP or FSDP (Megatron's wrappers both have
        it): here nothing is left, since the end-of-backward callback (runtime.post_backward_final) already
        waited for every reduce-scatter and set the sharded `.grad`s."""

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """All-gather every unit's full-precision shard and return the full parameters by original name
        (a collective: call on every rank), like `summon_full_params` followed by a copy."""
        full = {}
        for handle in self.handles():
            gathered = torch.empty(handle.padded_numel, dtype=handle.flat_param.dtype, device=handle.compute_device)
            all_gather_single(gathered, handle.flat_param.data.to(handle.compute_device), group=handle.process_group)
            for info in handle.infos:
                name = f"{handle.name}.{info.fqn}" if handle.name != "root" else info.fqn
                full[name] = gathered[info.offset : info.offset + info.numel].view(info.shape).cpu()
        return full


def _unowned_params(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name, owner, attribute) of every parameter of `module` outside already-wrapped units.

    Refuses what one flat buffer cannot represent: a parameter another unit already flattened (shared
    between units), a parameter reachable twice inside the unit, and non-floating-point parameters.
    """
    found: list[tuple[str, nn.Module, str]] = []
    seen: dict[int, str] = {}
    for prefix, mod in _modules_outside_units(module, ""):
        for attr, param in mod._parameters.items():
            if param is None:
                continue
            fqn = f"{prefix}{attr}"
            if getattr(param, "_reference_fsdp_flattened", False):
                raise ValueError(
                    f"parameter '{fqn}' is already flattened into another FSDP unit: a parameter "
                    "shared between units is not supported; wrap the modules sharing it in one unit"
                )
            if id(param) in seen:
                raise ValueError(
                    f"parameter '{fqn}' is the same tensor as '{seen[id(param)]}': shared "
                    "parameters inside one unit are not supported by the reference FSDP"
                )
            if not param.is_floating_point():
                raise ValueError(
                    f"parameter '{fqn}' has dtype {param.dtype}; FSDP shards floating-point parameters only"
                )
            seen[id(param)] = fqn
            found.append((fqn, mod, attr))
    dtypes = {getattr(mod, attr).dtype for _, mod, attr in found}
    if len(dtypes) > 1:
        raise ValueError(f"parameters of one unit must share a dtype to be flattened, found {sorted(map(str, dtypes))}")
    if len({getattr(mod, attr).requires_grad for _, mod, attr in found}) > 1:
        raise ValueError(
            "parameters of one unit must all require grad or all be frozen (one flat gradient); "
            "wrap frozen modules in their own unit"
        )
    for _, mod, attr in found:
        getattr(mod, attr)._reference_fsdp_flattened = True
    return found


def _modules_outside_units(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None and not isinstance(child, FullyShardedDataParallel):
            yield from _modules_outside_units(child, f"{prefix}{name}.")


def clean_name(name: str) -> str:
    """A module name without FSDP1's wrapper prefix (both wrappers use `_fsdp_wrapped_module`)."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")

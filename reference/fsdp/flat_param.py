"""Flat-parameter bookkeeping: one unit's parameters as one padded flat buffer, sharded 1/N per rank.

Mirrors `pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle` (torch 2.13.0) with
`pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle.flatten_tensors`,
`pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle.shard` and
`pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle._get_shard`,
`pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle.unshard` and
`pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle._all_gather_flat_param`,
`pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle.reshard` and
`pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle._free_unsharded_flat_param`,
and the `use_orig_params=True` views
`pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle._use_unsharded_views`,
`pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle._use_sharded_views` and
`pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle._use_sharded_grad_views`.

The memory trick is the same as upstream's: the unsharded buffer is one tensor whose *storage* is
resized to 0 after use and re-allocated (same storage object) before the next all-gather, so the views
autograd saved during forward become valid again when backward re-gathers into the same storage.

Deliberate difference: `flat_param.data` is the *padded* unsharded buffer (upstream uses an unpadded view
of it), so its gradient is already padded and reduce-scatters without upstream's `F.pad` copy
(`pytorch:torch/distributed/fsdp/_runtime_utils.py::_get_reduce_scatter_tensors`); the padding gradient is
zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.distributed as dist
from torch import nn

from reference.distributed import all_gather_single


class HandleTrainingState(Enum):
    """Per-handle state machine, as `_flat_param.py::HandleTrainingState`: prefetch reads it.

    Mirrors `pytorch:torch/distributed/fsdp/_common_utils.py::HandleTrainingState`.
    """

    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


@dataclass(frozen=True)
class ParamInfo:
    """Where an original parameter lives: its owner module and attribute, and its slice of the flat buffer."""

    fqn: str
    module: nn.Module
    attr: str
    shape: torch.Size
    offset: int
    numel: int


class FlatParamHandle:
    """Owns one unit's flat parameter: the fp32 local shard (`flat_param`), the unsharded buffer, the views.

    `flat_param` is the autograd leaf. Its `.data` points at the local shard when sharded and at the padded
    unsharded buffer (in `param_dtype`) when unsharded; the original `nn.Parameter` objects stay registered
    on their modules (so optimizers and `named_parameters` see real names) and are re-pointed at flattened
    views of the local shard, which is what the optimizer updates in place.
    """

    def __init__(
        self,
        params: list[tuple[str, nn.Module, str]],
        process_group: dist.ProcessGroup,
        compute_device: torch.device,
        param_dtype: torch.dtype | None,
        offload_to_cpu: bool,
    ) -> None:
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.compute_device = compute_device
        self.offload_to_cpu = offload_to_cpu
        self.orig_params: list[nn.Parameter] = [getattr(module, attr) for _, module, attr in params]
        self.param_dtype = param_dtype or self.orig_params[0].dtype
        # Each parameter starts on a 16-byte boundary of the unsharded buffer, as upstream does with
        # use_orig_params (`pytorch:torch/distributed/fsdp/_flat_param.py::_get_aligned_numel`; the padding
        # loop in `pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle._init_flat_param_and_metadata`):
        # same flat sizes, so the same bytes on the wire.
        aligned_numel = 16 // torch.empty((), dtype=self.param_dtype).element_size()
        self.infos: list[ParamInfo] = []
        offset = 0
        for (fqn, module, attr), param in zip(params, self.orig_params):
            offset += -offset % aligned_numel
            self.infos.append(ParamInfo(fqn, module, attr, param.shape, offset, param.numel()))
            offset += param.numel()
        self.numel = offset
        self.param_numel = sum(info.numel for info in self.infos)
        # Pad the end so every rank holds an equal shard
        # (`pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle._get_shard`,
        # `pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle.flatten_tensors`).
        self.shard_numel = -(-self.numel // self.world_size)
        self.padded_numel = self.shard_numel * self.world_size
        self._split_sizes = self._split_sizes_of_padded()  # fixed by the layout: computed once, used
        self._local_parts = self._parts_in_local_shard()  # at every unshard, reshard and grad hand-off
        self.flat_param = nn.Parameter(self._flatten_and_shard(), requires_grad=self.orig_params[0].requires_grad)
        self._local_shard = self.flat_param.data
        self._full_param_padded = torch.empty(self.padded_numel, dtype=self.param_dtype, device=compute_device)
        _free_storage(self._full_param_padded)
        self._unshard_work: dist.Work | None = None
        # Runtime state read by reference/fsdp/runtime.py and prefetch.py (names as upstream's).
        self.name = ""
        self.training_state = HandleTrainingState.IDLE
        self.prefetched = False
        self.needs_pre_forward_unshard = False
        self.needs_pre_backward_unshard = False
        self.ran_pre_backward_hook = False
        self.pre_forward_order_index: int | None = None
        self.post_forward_index: int | None = None
        self._use_sharded_views()

    def _flatten_and_shard(self) -> torch.Tensor:
        """`flatten_tensors` + `shard`: concatenate, pad with zeros, keep this rank's contiguous 1/N.

        Mirrors `pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle.flatten_tensors`
        and `pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle.shard`.
        """
        flat = torch.zeros(self.padded_numel, dtype=self.orig_params[0].dtype)
        for info, param in zip(self.infos, self.orig_params):
            flat[info.offset : info.offset + info.numel] = param.detach().reshape(-1).cpu()
        start = self.rank * self.shard_numel
        device = torch.device("cpu") if self.offload_to_cpu else self.compute_device
        return flat[start : start + self.shard_numel].clone().to(device)

    # -- unshard / reshard ------------------------------------------------------------------------------
    def is_unsharded(self) -> bool:
        """`pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle.needs_unshard` negated: is the unsharded
        buffer's storage
        allocated?"""
        return self._full_param_padded.untyped_storage().size() > 0

    def unshard(self) -> None:
        """Issue the all-gather of the shards into the unsharded buffer; point `flat_param` (and views) at it.

        `pre_unshard`/`_use_low_precision_shard` (1307, 1342) cast the shard to `param_dtype` on the compute
        device first; `unshard` (1359) skips the all-gather when the buffer is still allocated (the root
        keeps its parameters between forward and backward). Nothing waits here: see `wait_unshard`.

        Mirrors `pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle._all_gather_flat_param`.
        """
        if not self.is_unsharded():
            self._full_param_padded.untyped_storage().resize_(self.padded_numel * self._full_param_padded.itemsize)
            shard = self._local_shard.to(self.compute_device, self.param_dtype, non_blocking=True)
            self._unshard_work = all_gather_single(
                self._full_param_padded, shard, group=self.process_group, async_op=True
            )
        self.flat_param.data = self._full_param_padded
        if self.training_state in (HandleTrainingState.FORWARD, HandleTrainingState.BACKWARD_PRE):
            self._use_unsharded_views()  # in backward too: a recomputed (checkpointed) forward reads the modules

    def wait_unshard(self) -> None:
        """Block until this handle's outstanding all-gather (issued here or by a prefetch) has landed."""
        if self._unshard_work is not None:
            self._unshard_work.wait()
            self._unshard_work = None

    def reshard(self, free_unsharded: bool) -> None:
        """`reshard` (1766): point back at the local shard; free the unsharded storage unless told not to.

        Mirrors `pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle._free_unsharded_flat_param`.
        """
        self.wait_unshard()
        self.flat_param.data = self._local_shard
        self._use_sharded_views()
        if free_unsharded:
            _free_storage(self._full_param_padded)

    # -- views ------------------------------------------------------------------------------------------
    def _use_unsharded_views(self) -> None:
        """`_use_unsharded_views(as_params=False)`: modules see plain-tensor views into the unsharded buffer.

        The views are made from `flat_param` under autograd, so their gradients accumulate into
        `flat_param.grad` (the padded unsharded gradient) and its post-accumulate-grad hook fires once.

        Mirrors `pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle._use_unsharded_views`.
        """
        with torch.enable_grad():
            pieces = self.flat_param.split(self._split_sizes)
            for info, view in zip(self.infos, pieces[1::2]):
                _set_tensor_attr(info.module, info.attr, view.view(info.shape))

    def _split_sizes_of_padded(self) -> list[int]:
        """Sizes splitting the unsharded buffer into parameters and the padding between them (one split,
        so one backward node); even entries are padding, odd ones the parameters."""
        segments, end = [], 0
        for info in self.infos:
            segments += [info.offset - end, info.numel]
            end = info.offset + info.numel
        return segments + [self.padded_numel - end]

    def _parts_in_local_shard(self) -> list[slice]:
        """The part of each original parameter that lies in this rank's shard, as slices of the shard."""
        start, end = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        slices = []
        for info in self.infos:
            lo, hi = max(info.offset, start), min(info.offset + info.numel, end)
            slices.append(slice(lo - start, hi - start) if lo < hi else slice(0, 0))
        return slices

    def _use_sharded_views(self) -> None:
        """`_use_sharded_views`: each original `nn.Parameter` is a flat view of its part of the local shard
        (size 0 when it lies on other ranks), re-registered on its module so optimizers see it.

        Mirrors `pytorch:torch/distributed/fsdp/_flat_param.py::FlatParamHandle._use_sharded_views`.
        """
        for info, param, part in zip(self.infos, self.orig_params, self._local_parts):
            param.data = self._local_shard[part]
            if info.module._parameters.get(info.attr) is not param:
                delattr(info.module, info.attr)
                info.module.register_parameter(info.attr, param)

    def use_sharded_grad_views(self, sharded_grad: torch.Tensor) -> None:
        """`_use_sharded_grad_views`: each original parameter's `.grad` is a view of the reduced shard,
        accumulating into an existing gradient when the optimizer did not clear it (`_saved_grad_shard`)."""
        for param, part in zip(self.orig_params, self._local_parts):
            if param.grad is None:
                param.grad = sharded_grad[part]
            else:
                param.grad += sharded_grad[part]

    def sharded_param_bytes(self) -> int:
        """Bytes this rank keeps for the unit between steps: the padded shard."""
        return self._local_shard.numel() * self._local_shard.element_size()

    def unsharded_param_bytes(self) -> int:
        """Bytes currently allocated for the unit's unsharded buffer (0 when freed)."""
        return self._full_param_padded.untyped_storage().nbytes()


def _free_storage(tensor: torch.Tensor) -> None:
    """`torch/distributed/utils.py::_free_storage`: release the memory, keep the storage object."""
    tensor.untyped_storage().resize_(0)


def _set_tensor_attr(module: nn.Module, attr: str, tensor: torch.Tensor) -> None:
    """Replace a registered parameter by a plain tensor (`_flat_param.py::_setattr_tensor`)."""
    if attr in module._parameters:
        delattr(module, attr)
    setattr(module, attr, tensor)

"""One parameter under per-parameter FSDP: its dim-0 shard, its unsharded buffer, which of them the module sees.

Each parameter is cut on dim 0 into as many chunks as the shard group has ranks, as `torch.chunk` cuts it
(FSDP2's `Shard(0)` placement): chunks of ceil(rows / N) rows, the last ones short or empty. Every rank keeps a
zero-padded chunk of the full chunk size, so every all-gather input has the same size; the parameter the
optimizer sees is the unpadded rows of it. Shards are plain tensors, not DTensors: the shard is what an FSDP2
DTensor holds as its local tensor, and its layout is written out here once instead of riding on each tensor.

Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam`.
"""

from __future__ import annotations

from enum import Enum, auto

import torch
from torch import nn

from reference.fsdp2.mesh import ShardMesh


class ShardedState(Enum):
    """Which tensor the module holds: the shard, the shard kept on the smaller post-forward mesh
    (`reshard_after_forward=k`), or the unsharded parameter.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::ShardedState`.
    """

    SHARDED = auto()
    SHARDED_POST_FORWARD = auto()
    UNSHARDED = auto()


class ShardedParam:
    """`sharded_param` (an `nn.Parameter`, this rank's unpadded rows) lives in `padded_shard` (the all-gather
    input); `unsharded_param` (an `nn.Parameter`, the autograd leaf of forward and backward) lives in
    `all_gather_output`, whose storage is freed between uses and re-allocated in place, so that tensors autograd
    saved in forward see the re-gathered values in backward."""

    def __init__(self, fqn: str, module: nn.Module, name: str, mesh: ShardMesh, device: torch.device) -> None:
        """Shard `module.<name>` (`fqn` in the `fully_shard`-ed module) over `mesh.shard_group`, and put the
        shard on the module in its place.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam._init_sharded_param`.
        """
        param = getattr(module, name)
        self.module, self.name, self.fqn = module, name, fqn  # fqn: prefixed from the root at lazy init
        self.orig_size, self.orig_dtype = param.shape, param.dtype
        world, rank = mesh.shard_size, mesh.shard_rank
        rows = param.shape[0]
        self.padded_rows = -(-rows // world)  # torch.chunk's chunk size: rows padded to a multiple of world
        first = min(rank * self.padded_rows, rows)
        self.local_rows = min(first + self.padded_rows, rows) - first
        padded = torch.zeros((self.padded_rows, *param.shape[1:]), dtype=param.dtype, device=device)
        padded[: self.local_rows] = param.detach()[first : first + self.local_rows]
        self.padded_shard = padded.view(-1)
        self.shard_numel = self.padded_shard.numel()
        self.sharded_param = nn.Parameter(padded[: self.local_rows], requires_grad=param.requires_grad)
        self.param_dtype = param.dtype  # set by ParamGroup.init_dtypes from the MixedPrecisionPolicy
        self.all_gather_output: torch.Tensor | None = None  # created at the first all-gather
        self.unsharded_param: nn.Parameter | None = None
        self.post_forward_shard: torch.Tensor | None = None
        self.state = ShardedState.SHARDED
        module._parameters[name] = self.sharded_param

    def all_gather_input(self) -> torch.Tensor:
        """What this rank contributes to the all-gather, 1-D in `param_dtype`: the padded shard, or after
        `to_sharded_post_forward` the shard it kept on the smaller mesh.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam.all_gather_inputs`.
        """
        if self.state == ShardedState.SHARDED_POST_FORWARD:
            return self.post_forward_shard
        return self.padded_shard.to(self.param_dtype)

    def alloc_all_gather_output(self, world: int) -> torch.Tensor:
        """The padded unsharded buffer (`world` chunks), its storage allocated; made once, with the unsharded
        parameter viewing its first `orig_size` elements.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam.init_unsharded_param`.
        """
        if self.all_gather_output is None:
            self.all_gather_output = torch.empty(
                self.shard_numel * world, dtype=self.param_dtype, device=self.padded_shard.device
            )
            view = self.all_gather_output[: self.orig_size.numel()].view(self.orig_size)
            self.unsharded_param = nn.Parameter(view, requires_grad=self.sharded_param.requires_grad)
        storage = self.all_gather_output.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.all_gather_output.numel() * self.all_gather_output.itemsize)
        return self.all_gather_output

    def free_unsharded(self) -> None:
        """Release the unsharded buffer's memory, keeping the storage object (and every view of it)."""
        if self.all_gather_output is not None:
            self.all_gather_output.untyped_storage().resize_(0)

    def to_unsharded(self) -> None:
        """The module computes with the unsharded parameter (the all-gather's copy-out has filled it).

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam.to_unsharded`.
        """
        self.module._parameters[self.name] = self.unsharded_param
        self.post_forward_shard = None
        self.state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        """The module holds the shard again; the unsharded buffer is freed.

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam.to_sharded`.
        """
        self.module._parameters[self.name] = self.sharded_param
        self.free_unsharded()
        self.state = ShardedState.SHARDED

    def to_sharded_post_forward(self, post_forward: ShardMesh) -> None:
        """Keep this rank's 1/k of the unsharded buffer (k = the post-forward mesh's size, a divisor of the
        shard group's), free the rest: backward all-gathers over the k ranks only. The module holds the
        regular shard meanwhile (upstream registers the post-forward shard there; nothing computes with either).

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam.to_sharded_post_forward`.
        """
        numel = self.all_gather_output.numel() // post_forward.shard_size
        start = numel * post_forward.shard_rank
        self.post_forward_shard = self.all_gather_output[start : start + numel].clone()
        self.module._parameters[self.name] = self.sharded_param
        self.free_unsharded()
        self.state = ShardedState.SHARDED_POST_FORWARD

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The gradient autograd accumulated into the unsharded parameter, detached from it."""
        grad, self.unsharded_param.grad = self.unsharded_param.grad, None
        return grad

    def add_sharded_grad(self, flat: torch.Tensor) -> None:
        """Hand this rank's reduced chunk (`shard_numel` elements, padding last) to `sharded_param.grad`,
        accumulating into a gradient the optimizer has not cleared."""
        grad = flat[: self.sharded_param.numel()].view(self.sharded_param.shape)
        if self.sharded_param.grad is None:
            self.sharded_param.grad = grad
        else:
            self.sharded_param.grad += grad

"""Shard a model one FSDP unit per layer, then the root, with either reference FSDP or either of torch's.

One wrapping shared by the FSDP demo, the trace recorder (tools/trace_worker.py), the FSDP tests and the
FSDP benchmarks, so that all of them compare the same units: each of `model.layers` (the transformer blocks
of reference.gpt.model.GPT) first, then the root (embedding, final norm, output layer), as
torchtitan's `apply_fsdp` does with `fully_shard`. `sharded_parameter_bytes` (FSDP1) and `padded_shard_bytes`
(FSDP2) are the per-rank parameter memory the demos print.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from reference.fsdp.prefetch import BackwardPrefetch
from reference.fsdp.wrapper import CPUOffload, FullyShardedDataParallel, MixedPrecision
from reference.parallel_state import ParallelLayout, build_layout

IMPLEMENTATIONS = ("reference", "fsdp1", "reference-fsdp2", "fsdp2")


def shard_model(
    model: nn.Module,
    implementation: str,
    process_group: dist.ProcessGroup,
    *,
    backward_prefetch: str | None = "BACKWARD_PRE",
    forward_prefetch: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool | int | None = None,
    replicas: int = 1,
) -> nn.Module:
    """One unit per layer, then the root: `implementation` is one of IMPLEMENTATIONS: "reference" (the
    reference FSDP1), "fsdp1", "reference-fsdp2" (reference.fsdp2) or "fsdp2" (torch's `fully_shard`). The
    FSDP2s prefetch in backward implicitly (`backward_prefetch` is not theirs); `forward_prefetch` sets each
    unit to prefetch the next explicitly; `reshard_after_forward` (given: for every unit, the root included)
    and `replicas` (HSDP: that many replicas of a shard group of world / replicas ranks) are theirs alone."""
    device = next(model.parameters()).device
    if implementation in ("reference-fsdp2", "fsdp2"):
        return _fully_shard_model(
            model,
            implementation == "fsdp2",
            process_group,
            device,
            forward_prefetch=forward_prefetch,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            cpu_offload=cpu_offload,
            reshard_after_forward=reshard_after_forward,
            replicas=replicas,
        )
    if (reshard_after_forward, replicas) != (None, 1):
        raise ValueError(f"reshard_after_forward and replicas are FSDP2's; {implementation!r} is FSDP1")
    if implementation == "fsdp1":
        from torch.distributed import fsdp as torch_fsdp

        wrap_unit = lambda module: torch_fsdp.FullyShardedDataParallel(
            module,
            process_group,
            use_orig_params=True,
            device_id=device,
            forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch and torch_fsdp.BackwardPrefetch[backward_prefetch],
            mixed_precision=torch_fsdp.MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
            cpu_offload=torch_fsdp.CPUOffload(offload_params=cpu_offload),
        )
    elif implementation == "reference":
        wrap_unit = lambda module: FullyShardedDataParallel(
            module,
            process_group,
            forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch and BackwardPrefetch[backward_prefetch],
            mixed_precision=MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
            cpu_offload=CPUOffload(offload_params=cpu_offload),
        )
    else:
        expected = ", ".join(IMPLEMENTATIONS)
        raise ValueError(f"unknown FSDP implementation {implementation!r}; expected one of {expected}")
    for index, layer in enumerate(model.layers):
        model.layers[index] = wrap_unit(layer)
    return wrap_unit(model)


def sharded_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds between steps (the original parameters are views of shards)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _fully_shard_model(
    model: nn.Module,
    use_torch: bool,
    process_group: dist.ProcessGroup,
    device: torch.device,
    *,
    forward_prefetch: bool,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    cpu_offload: bool,
    reshard_after_forward: bool | int | None,
    replicas: int,
) -> nn.Module:
    """`fully_shard` each layer, then the model, with torch's FSDP2 or the reference's, on the same mesh."""
    layout = _hsdp_layout(process_group, replicas) if replicas > 1 else None
    if use_torch:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        hsdp = ("dp_replicate", "dp_shard")
        mesh = layout.device_mesh(hsdp, device.type) if layout else DeviceMesh.from_group(process_group, device.type)
        options = dict(
            mesh=mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
            offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        )
    else:
        from reference.fsdp2 import MixedPrecisionPolicy, ShardMesh, fully_shard

        if cpu_offload:
            raise ValueError("the reference FSDP2 keeps its shards on the compute device: no CPU offload")
        mesh = ShardMesh.from_layout(layout) if layout else ShardMesh.flat(process_group)
        options = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    if reshard_after_forward is not None:
        options["reshard_after_forward"] = reshard_after_forward
    for layer in model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    if forward_prefetch:
        units = [model, *model.layers]
        for unit, following in zip(units, units[1:]):
            unit.set_modules_to_forward_prefetch([following])
    return model


def _hsdp_layout(process_group: dist.ProcessGroup, replicas: int) -> ParallelLayout:
    """The world as `replicas` replicas of a shard group of consecutive ranks (HSDP over `process_group`, which
    must be the world: under TP or PP, build the layout with `dp_replicate`)."""
    if dist.get_process_group_ranks(process_group) != list(range(dist.get_world_size())):
        raise ValueError("HSDP here shards the whole world; under TP or PP use build_layout(..., dp_replicate=R)")
    return build_layout(tp_size=1, dp_replicate=replicas)


def padded_shard_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds between steps under FSDP2 (either): each parameter's padded dim-0
    shard, which its parameter (torch's: its DTensor's local tensor) views the unpadded rows of."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())

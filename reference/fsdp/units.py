"""Shard a model one FSDP unit per layer, then the root, with the reference FSDP or either of torch's.

One wrapping shared by the FSDP demo, the trace recorder (tools/trace_worker.py), the FSDP tests and the
FSDP benchmark, so that all of them compare the same units: each of `model.layers` (the transformer blocks
of reference.gpt.model.GPT) first, then the root (embedding, final norm, output layer), as
torchtitan's `apply_fsdp` does with `fully_shard`. `sharded_parameter_bytes` is the per-rank parameter memory the demos
print.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from reference.fsdp.prefetch import BackwardPrefetch
from reference.fsdp.wrapper import CPUOffload, FullyShardedDataParallel, MixedPrecision


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
) -> nn.Module:
    """One unit per layer, then the root: `implementation` is "reference", "fsdp1" or "fsdp2" (torch's
    `fully_shard`, which has no prefetch policy and offloads through its own policy object)."""
    device = next(model.parameters()).device
    if implementation == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mesh = DeviceMesh.from_group(process_group, device.type)
        options = dict(
            mesh=mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
            offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        )
        for layer in model.layers:
            fully_shard(layer, **options)
        return fully_shard(model, **options)
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
        raise ValueError(f"unknown FSDP implementation {implementation!r}; expected reference, fsdp1 or fsdp2")
    for index, layer in enumerate(model.layers):
        model.layers[index] = wrap_unit(layer)
    return wrap_unit(model)


def sharded_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds between steps (the original parameters are views of shards)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())

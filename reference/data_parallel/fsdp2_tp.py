"""2D parallelism with the per-parameter FSDP: tensor parallelism inside the TP group, reference.fsdp2 across
the DP group.

`fully_shard_tp_model(model, layout)` calls reference.fsdp2's `fully_shard` on every TP block of a TP-sharded
model, then on the model, over `layout.dp_group` (HSDP: the layout's dp_replicate x dp_shard). A TP layer holds
this rank's slice as a plain tensor, and FSDP2 cuts that tensor on dim 0 over the DP ranks holding the same slice,
parameter by parameter, with no change to either. Under sequence parallelism the TP sum of the replicated
parameters' gradients runs after the reduce-scatter, on the shards, as with FSDP1 (reference.data_parallel.fsdp_tp).

Counterpart: torchtitan's parallelize_llama (`parallelize_module` on the "tp" mesh dimension, then `fully_shard`
on "dp"), which `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam._init_sharding_spec_tp`
handles and the tests compare against.
"""

from __future__ import annotations

from torch import nn

from reference.data_parallel.fsdp_tp import check_tp_model, tp_blocks
from reference.fsdp2 import ShardMesh, fully_shard
from reference.parallel_state import ParallelLayout


def fully_shard_tp_model(model: nn.Module, layout: ParallelLayout, **fsdp_kwargs) -> nn.Module:
    """`fully_shard` each TP block of `model` (split by reference.tensor_parallel.parallelize or
    reference.gpt.parallelize), then `model`, on the DP group (HSDP where the layout has `dp_replicate` > 1:
    `ShardMesh.from_layout`); returns `model`, now the root `FSDPModule`. `fsdp_kwargs` go to every call
    (`reshard_after_forward`, `mp_policy`). Sequence-parallel parameters keep their mark on their shards, so
    that `allreduce_sequence_parallel_grads(model, layout.tp_group)` after backward sums their sharded gradients.

    How this mirrors FSDP2 over a DTensor TP parameter. Upstream, TP leaves a DTensor on the "tp" mesh
    (Shard(0) for a column-parallel weight, Shard(1) for a row-parallel one, Replicate for a norm) whose local
    tensor is this rank's slice, the tensor a reference TP layer holds. `fully_shard` on the "dp" mesh shards
    that local tensor on dim 0 over dp, padded as any parameter (`FSDPParam._init_sharding_spec_tp` returns it
    as the data to shard), and records a 2-D spec on the concatenated (dp, tp) mesh: (Shard(0), tp's
    placement), or (_StridedShard(0, split_factor=tp), Shard(0)) when TP already cut dim 0, so that
    `full_tensor()` knows each dp chunk lies inside a tp chunk. The collectives see local tensors only, so the
    spec is metadata: here the layout is written once (TP slice, then its DP chunk) instead of riding on every
    tensor, and the all-gathers and reduce-scatters over dp carry the same bytes.

    Gradients: upstream `FSDPParam._get_grad_inner_tensor` redistributes each unsharded gradient DTensor to the
    parameter's TP placements before the reduce-scatter: for a SequenceParallel norm weight (Replicate,
    gradient Partial) an all-reduce of the whole gradient over tp, one per parameter. The reference keeps
    Megatron's order: reduce-scatter over dp first, then one all-reduce over tp of the sequence-parallel
    shards, 1/dp of the bytes. Sums commute: the same gradients up to fp32 rounding.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam._init_sharding_spec_tp` and
    `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam._get_grad_inner_tensor`.
    """
    blocks = tp_blocks(model)
    check_tp_model(model, blocks, layout, "fully_shard_tp_model")
    marked = [
        (module, name)
        for module in model.modules()
        for name, param in module.named_parameters(recurse=False)
        if getattr(param, "sequence_parallel", False)
    ]
    mesh = ShardMesh.from_layout(layout)
    for _, block in blocks:
        fully_shard(block, mesh, **fsdp_kwargs)
    fully_shard(model, mesh, **fsdp_kwargs)
    for module, name in marked:  # the shard now sits where the parameter was
        module._parameters[name].sequence_parallel = True
    return model

"""2D parallelism: tensor parallelism inside the TP group (a node), FSDP across the DP group (between nodes).

`shard_tp_model(model, layout)` wraps every TP block of a TP-sharded model in a reference FSDP unit on
`layout.dp_group`, and the model itself in the root unit. Each TP rank flattens its own shards of a block and
FSDP splits that flat buffer 1/dp over the ranks holding the same TP slices; the DP group is orthogonal to the
TP group, so FSDP needs no change. Under sequence parallelism the TP sum of the replicated parameters' gradients
runs after the reduce-scatter, on the shards (reference.data_parallel.finalize).

Counterpart: torchtitan's parallelize_llama (TP, then `fully_shard` on the "dp" mesh dimension), and
`pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam`, which the tests compare against.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from reference.fsdp import FullyShardedDataParallel
from reference.parallel_state import ParallelConfigError, ParallelLayout
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.transformer import Block


def shard_tp_model(model: nn.Module, layout: ParallelLayout, **fsdp_kwargs) -> FullyShardedDataParallel:
    """Wrap each TP block (a Block split by reference.tensor_parallel.parallelize) of `model` (in place), then `model`,
    in FSDP units on the DP group. `fsdp_kwargs` go to every FullyShardedDataParallel (prefetch, mixed
    precision, ...). A collective.

    Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam._init_sharded_param`.
    """
    blocks = tp_blocks(model)
    check_tp_model(model, blocks, layout, "shard_tp_model")
    for name, block in blocks:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, FullyShardedDataParallel(block, layout.dp_group, **fsdp_kwargs))
    return FullyShardedDataParallel(model, layout.dp_group, **fsdp_kwargs)


def tp_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of every Block of `model` that reference.tensor_parallel.parallelize has split."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, Block) and isinstance(m.attention.qkv, ColumnParallelLinear)
    ]


def check_tp_model(model: nn.Module, blocks: list[tuple[str, nn.Module]], layout: ParallelLayout, caller: str) -> None:
    """Raise the same one-line error, prefixed `caller`, on every rank (never leave some ranks waiting in a
    collective) when a rank's model is not TP-sharded for this layout, or its parameter shapes differ from a TP
    or DP peer's."""
    problem = _local_problem(model, blocks, layout)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (problem, [(n, tuple(p.shape)) for n, p in model.named_parameters()]))
    for rank, (other_problem, _) in enumerate(everyone):
        if other_problem:
            raise ParallelConfigError(f"{caller}: rank {rank}: {other_problem}")
    for kind in ("tp", "dp"):  # every rank checks every group, so every rank raises the same error
        for ranks in layout.ranks(kind):
            first = everyone[ranks[0]][1]
            for peer in ranks[1:]:
                theirs = everyone[peer][1]
                if theirs != first:
                    name, shape = ([s for s in theirs if s not in first] + [s for s in first if s not in theirs])[0]
                    raise ParallelConfigError(
                        f"{caller}: parameter shapes differ between ranks {ranks[0]} and {peer} of "
                        f"{kind.upper()} group {ranks} (first: '{name}' {list(shape)}); FSDP x TP needs one flat "
                        f"layout per TP and per DP group"
                    )


def _local_problem(model: nn.Module, blocks: list[tuple[str, nn.Module]], layout: ParallelLayout) -> str | None:
    """What is wrong with this rank's model, or None."""
    if not blocks:
        return (
            f"{type(model).__name__} has no tensor-parallel block to wrap; split it first with "
            "reference.tensor_parallel.parallelize.parallelize(model, layout)"
        )
    tp_ranks = dist.get_process_group_ranks(layout.tp_group)
    for prefix, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if dist.get_process_group_ranks(module.tp_group) != tp_ranks:
            return (
                f"{prefix} was built for the TP group {dist.get_process_group_ranks(module.tp_group)}, "
                f"but the layout's TP group is {tp_ranks}"
            )
        if hasattr(module.weight, "main_grad"):
            return f"{prefix} uses gradient_accumulation_fusion (main_grad), which FSDP's flat views cannot carry"
        expected = (
            (module.output_size_per_partition, module.input_size)
            if isinstance(module, ColumnParallelLinear)
            else (module.output_size, module.input_size_per_partition)
        )
        if tuple(module.weight.shape) != expected:
            return (
                f"{prefix}.weight has shape {list(module.weight.shape)}, expected {list(expected)}: a "
                f"TP-sharded layer must hold this rank's 1/{len(tp_ranks)} slice, not the full weight"
            )
    return None

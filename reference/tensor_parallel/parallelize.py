"""`parallelize(model, layout)`: tensor parallelism applied to the plain blocks by swapping their layers.

Each block's QKV and fc1 become ColumnParallelLinear, its output projection and fc2 RowParallelLinear,
holding this rank's slice of the weights the block already has (picotron's `apply_tensor_parallel`,
torchtitan's `parallelize_llama`). Per block and direction that is two all-reduces of [s, b, h], or under
sequence parallelism an all-gather before each column layer and a reduce-scatter after each row layer, the
stack splitting the sequence on entry and gathering it on exit (Korthikanti et al. 2022). Llama's QKV
splits by whole query groups, SwiGLU's [gate; up] with stride 2. Dropout on split activations draws from
the TP stream (reference.tensor_parallel.random), which recomputation restores (reference.recompute).

Mirrors `megatron-lm:megatron/core/transformer/attention.py::SelfAttention` and
`megatron-lm:megatron/core/transformer/mlp.py::MLP.__init__`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.parallel_state import ParallelConfigError, ParallelLayout, divide
from reference.recompute import set_recompute
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_of
from reference.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from reference.tensor_parallel.random import TensorParallelRNG
from reference.tensor_parallel.transformer import Block


def split_query_groups(num_attention_heads: int, num_kv_heads: int, tp_size: int) -> int:
    """Query groups (key/value heads) per TP rank; refuses a TP size that does not divide both head counts.

    Megatron-core replicates k/v heads when there are fewer than TP ranks (`num_query_groups < world_size`);
    the reference refuses instead: replicated k/v weights would need their own gradient sum.

    Mirrors `megatron-lm:megatron/core/transformer/attention.py::Attention.__init__`.
    """
    divide(num_attention_heads, tp_size, "num_attention_heads", by="the tensor-parallel size")
    if num_kv_heads < tp_size:
        raise ParallelConfigError(
            f"{num_kv_heads} key/value heads cannot be split over tensor-parallel size {tp_size}: each rank needs "
            f"a whole key/value head (Megatron replicates them instead; this reference does not), lower --tp"
        )
    return divide(num_kv_heads, tp_size, "num_kv_heads (key/value heads)", by="the tensor-parallel size")


def _swap(linear: torch.nn.Linear, kind: type, tp_group: dist.ProcessGroup, stride: int = 1, **options):
    """A Column/RowParallelLinear holding this rank's slice of `linear`'s weight and bias, returning a tensor."""
    full = linear.weight.detach()
    layer = kind(
        linear.in_features,
        linear.out_features,
        tp_group=tp_group,
        init_method=lambda master: master.copy_(full),
        bias=linear.bias is not None,
        params_dtype=full.dtype,
        device=full.device,
        return_bias=False,
        **({"stride": stride} if kind is ColumnParallelLinear else {"input_is_parallel": True}),
        **options,
    )
    if linear.bias is not None:
        with torch.no_grad():
            layer.bias.copy_(
                shard_of(linear.bias, 0, tp_group, stride) if kind is ColumnParallelLinear else linear.bias
            )
    return layer


def parallelize_block(
    block: Block,
    tp_group: dist.ProcessGroup,
    *,
    rng: TensorParallelRNG | None = None,
    sequence_parallel: bool = False,
    recompute: str = "none",
    async_grad_allreduce: bool = True,
    gradient_accumulation_fusion: bool = False,
) -> Block:
    """Split one block over `tp_group` in place: heads (whole query groups) and MLP columns per rank.

    `rng`: the stream dropout on split activations draws from; without one the block gets its own (seed 0).
    `recompute`: "none", "selective" (the attention core) or "full" (the whole layer).
    """
    attention, mlp, tp = block.attention, block.mlp, tp_group.size()
    if not isinstance(attention.qkv, torch.nn.Linear):
        raise ParallelConfigError(f"{type(block).__name__} is already split over a TP group; parallelize it once")
    heads = attention.qkv.in_features // attention.head_dim
    split_query_groups(heads, heads // attention.queries_per_group, tp)
    sp = sequence_parallel and tp > 1  # as Megatron: off at TP=1
    options = dict(
        sequence_parallel=sp,
        async_grad_allreduce=async_grad_allreduce,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
    )
    attention.qkv = _swap(attention.qkv, ColumnParallelLinear, tp_group, **options)
    attention.proj = _swap(attention.proj, RowParallelLinear, tp_group, **options)
    mlp.fc1 = _swap(mlp.fc1, ColumnParallelLinear, tp_group, stride=2 if mlp.gated else 1, **options)
    mlp.fc2 = _swap(mlp.fc2, RowParallelLinear, tp_group, **options)
    block.rng = attention.rng = rng or TensorParallelRNG(0, tp_group, block.ln1.weight.device)
    set_recompute(block, recompute)
    block.sequence_parallel = sp
    for param in [*block.ln1.parameters(), *block.ln2.parameters()]:
        param.sequence_parallel = sp  # replicated, but sees only local tokens under SP: partial grads
    return block


class _SequenceParallelStack:
    """A stage's entry and exit under SP when it is fed whole [s, b, h] activations (`hidden=`): split the
    sequence (padded to a multiple of tp if allowed) on the way in, gather it and drop the pad on the way out."""

    def __init__(self, tp_group: dist.ProcessGroup, pad_sequence: bool):
        self.tp_group, self.pad_sequence, self.seq_length = tp_group, pad_sequence, None

    def enter(self, module, args, kwargs):
        x = kwargs["hidden"]
        self.seq_length, tp = x.shape[0], self.tp_group.size()
        if self.seq_length % tp:
            if not self.pad_sequence:
                raise ParallelConfigError(
                    f"sequence length {self.seq_length} is not divisible by the tensor-parallel size {tp}, "
                    "which sequence parallelism splits it by; pad it or pass pad_sequence=True"
                )
            x = F.pad(x, (0, 0, 0, 0, 0, tp - self.seq_length % tp))
        return args, {**kwargs, "hidden": scatter_to_sequence_parallel_region(x, self.tp_group)}

    def exit(self, module, args, kwargs, output):
        full = gather_from_sequence_parallel_region(output, self.tp_group, tensor_parallel_output_grad=False)
        return full[: self.seq_length]


def parallelize(
    model: torch.nn.Module,
    layout: ParallelLayout | dist.ProcessGroup,
    *,
    sequence_parallel: bool = False,
    pad_sequence: bool = False,
    dropout_seed: int = 0,
    **block_options,
) -> torch.nn.Module:
    """Split every block of `model.layers` over the layout's TP group (or the group given), in place.

    With sequence parallelism, a middle stage of reference.gpt.model.GPT fed whole [s, b, h] activations
    (`model(None, None, hidden=x)`) splits them on entry and gathers them on exit; `pad_sequence` pads a sequence
    the TP size does not divide, and trims it on exit (causal attention keeps real tokens blind to the pad). The
    blocks share one TP stream, seeded with `dropout_seed`. `block_options`: parallelize_block's.
    """
    tp_group = layout.tp_group if isinstance(layout, ParallelLayout) else layout
    device = next(model.parameters()).device
    rng = TensorParallelRNG(dropout_seed, tp_group, device)
    for block in model.layers:
        parallelize_block(block, tp_group, rng=rng, sequence_parallel=sequence_parallel, **block_options)
    if sequence_parallel and tp_group.size() > 1:
        region = _SequenceParallelStack(tp_group, pad_sequence)
        model.register_forward_pre_hook(region.enter, with_kwargs=True)
        model.register_forward_hook(region.exit, with_kwargs=True)
    return model

"""The transformer block, tensor-parallel: attention heads and MLP columns split across the TP group.

Per block and per direction, without sequence parallelism, exactly two all-reduces of a [s, b, h] tensor:
  forward:  attention output projection (row, g), MLP fc2 (row, g)
  backward: QKV input gradient (column, f),        MLP fc1 input gradient (column, f)
With sequence_parallel the activations outside attention/MLP (LayerNorm, dropout, residual) are split along
the sequence, and each all-reduce becomes its two halves: an all-gather before the column layer and a
reduce-scatter after the row layer (Korthikanti et al. 2022; megatron/core/transformer/ with
config.sequence_parallel). Backward additionally re-gathers each column layer's input (see linear_kernel).

Parameters are named and initialized exactly as in reference.tensor_parallel.unsharded, so after the same
seed each rank holds its slice of the unsharded model's weights. Dropout on split activations (attention
heads; the residual stream under SP) draws from a per-rank stream (reference.tensor_parallel.random).

ParallelLlamaBlock is the Llama/Qwen2 block (unsharded.LlamaBlock) split the same way, with the same
collectives: QKV column-parallel with whole query groups (a key/value head and its query heads) per rank,
SwiGLU's fused [gate; up] column-parallel with stride 2 (each rank holds its gate columns next to the
matching up columns), o and down row-parallel, RMSNorm under sequence parallelism like LayerNorm.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.parallel_state import ParallelConfigError, divide
from reference.recompute import check_mode as check_recompute_mode
from reference.recompute import checkpoint
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from reference.tensor_parallel.random import TensorParallelRNG
from reference.tensor_parallel.unsharded import (
    causal_self_attention,
    grouped_query_attention,
    init_method_normal,
    swiglu,
)


def _recomputed(module: torch.nn.Module, enabled: bool, function: Callable, *args: torch.Tensor) -> torch.Tensor:
    """function(*args); with `enabled`, in a training forward that autograd records, checkpointed on the module's
    TP stream (reference.recompute): only `args` are kept, the rest runs again in backward. The one dispatch of
    both recompute modes: selective (the attention core) and full (the whole block)."""
    if enabled and module.training and torch.is_grad_enabled():
        return checkpoint(function, module.rng, *args)
    return function(*args)


class ParallelAttention(torch.nn.Module):
    """QKV column-parallel (each rank gets num_attention_heads / p whole heads), attention on the local
    heads, output projection row-parallel. Returns (output, bias) with the bias not yet added.
    With `selective_recompute` the attention core keeps only its input for backward (reference.recompute).

    Mirrors `megatron-lm:megatron/core/transformer/attention.py::SelfAttention`.
    """

    def __init__(
        self, hidden_size, num_attention_heads, attention_dropout, rng, linear_kwargs, selective_recompute: bool = False
    ):
        super().__init__()
        self.rng, self.selective_recompute = rng, selective_recompute
        divide(num_attention_heads, linear_kwargs["tp_group"].size(), "num_attention_heads")
        self.head_dim = divide(hidden_size, num_attention_heads, "hidden_size", by="num_attention_heads")
        self.attention_dropout = attention_dropout
        self.qkv = ColumnParallelLinear(hidden_size, 3 * hidden_size, **linear_kwargs)
        self.proj = RowParallelLinear(
            hidden_size, hidden_size, input_is_parallel=True, skip_bias_add=True, **linear_kwargs
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, _ = self.qkv(x)
        return self.proj(_recomputed(self, self.selective_recompute, self.core_attention, qkv))

    def core_attention(self, qkv: torch.Tensor) -> torch.Tensor:
        """QK^T, softmax, dropout, x V on this rank's heads: the region selective recomputation re-runs.

        Mirrors `megatron-lm:megatron/core/transformer/attention.py::Attention._checkpointed_attention_forward`.
        """
        p = self.attention_dropout if self.training else 0.0
        with self.rng.fork() if p > 0 else contextlib.nullcontext():  # this rank's heads: its own masks
            return causal_self_attention(qkv, self.head_dim, p)


class ParallelMLP(torch.nn.Module):
    """fc1 column-parallel -> GELU on the local columns -> fc2 row-parallel. Returns (output, bias).

    Mirrors `megatron-lm:megatron/core/transformer/mlp.py::MLP.forward`.
    """

    def __init__(self, hidden_size, ffn_hidden_size, linear_kwargs):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden_size, ffn_hidden_size, **linear_kwargs)
        self.fc2 = RowParallelLinear(
            ffn_hidden_size, hidden_size, input_is_parallel=True, skip_bias_add=True, **linear_kwargs
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, _ = self.fc1(x)
        return self.fc2(F.gelu(hidden))


class ParallelBlock(torch.nn.Module):
    """What the GPT-2 and the Llama block share: the TP stream, the recompute mode (none, selective, full;
    reference.recompute), sequence parallelism, the keyword arguments every linear layer of the block takes,
    and the layout norm1 -> attention -> norm2 -> MLP, the norms marked as seeing only local tokens under SP.
    A block passes the factories of its norm, attention and MLP and writes `layer_forward`, the layer itself:
    what full recompute checkpoints.

    `rng` is the TP stream that dropout on split activations draws from and recomputation restores; without
    one the block makes its own (seed 0)."""

    def __init__(
        self,
        *,
        tp_group: dist.ProcessGroup,
        norm: Callable[..., torch.nn.Module],
        attention: Callable[[dict, TensorParallelRNG, bool], torch.nn.Module],
        mlp: Callable[[dict], torch.nn.Module],
        init_method: Callable | None = None,
        sequence_parallel: bool = False,
        async_grad_allreduce: bool = True,
        gradient_accumulation_fusion: bool = False,
        params_dtype=torch.float32,
        device=None,
        rng: TensorParallelRNG | None = None,
        recompute: str = "none",
    ):
        super().__init__()
        self.recompute = check_recompute_mode(recompute)
        self.sequence_parallel = sequence_parallel and tp_group.size() > 1
        self.rng = rng or TensorParallelRNG(0, tp_group, device)
        linear_kwargs = dict(
            tp_group=tp_group,
            init_method=init_method or init_method_normal(),
            sequence_parallel=self.sequence_parallel,
            async_grad_allreduce=async_grad_allreduce,
            gradient_accumulation_fusion=gradient_accumulation_fusion,
            params_dtype=params_dtype,
            device=device,
        )
        self.ln1 = norm(dtype=params_dtype, device=device)
        self.attention = attention(linear_kwargs, self.rng, recompute == "selective")
        self.ln2 = norm(dtype=params_dtype, device=device)
        self.mlp = mlp(linear_kwargs)
        for param in [*self.ln1.parameters(), *self.ln2.parameters()]:
            param.sequence_parallel = self.sequence_parallel  # replicated, but sees only local tokens under SP

    def forward(self, x: torch.Tensor, *layer_inputs: torch.Tensor) -> torch.Tensor:
        """layer_forward(x, *layer_inputs); with full recompute the whole layer runs again in backward
        (reference.recompute), as
        `megatron-lm:megatron/core/transformer/transformer_block.py::TransformerBlock._checkpointed_forward`
        does."""
        return _recomputed(self, self.recompute == "full", self.layer_forward, x, *layer_inputs)


class ParallelTransformerBlock(ParallelBlock):
    """Pre-LayerNorm block: x + attention(ln1(x)), then + mlp(ln2(x)), the row biases added in the
    bias-dropout-add as Megatron does (hence skip_bias_add on the row layers). `shared`: ParallelBlock's
    keyword arguments (init_method, sequence_parallel, params_dtype, device, rng, recompute, ...)."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        *,
        tp_group: dist.ProcessGroup,
        ffn_hidden_size: int | None = None,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        **shared,
    ):
        super().__init__(
            tp_group=tp_group,
            norm=functools.partial(torch.nn.LayerNorm, hidden_size),
            attention=lambda linear_kwargs, rng, selective: ParallelAttention(
                hidden_size, num_attention_heads, attention_dropout, rng, linear_kwargs, selective_recompute=selective
            ),
            mlp=lambda linear_kwargs: ParallelMLP(hidden_size, ffn_hidden_size or 4 * hidden_size, linear_kwargs),
            **shared,
        )
        self.hidden_dropout = hidden_dropout

    def bias_dropout_add(self, out: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(out + bias); under SP each rank holds other tokens, so it draws its own mask."""
        split = self.sequence_parallel and self.training and self.hidden_dropout > 0
        with self.rng.fork() if split else contextlib.nullcontext():
            return residual + F.dropout(out + bias, self.hidden_dropout, self.training)

    def layer_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mirrors `megatron-lm:megatron/core/transformer/transformer_layer.py::TransformerLayer.forward`."""
        out, bias = self.attention(self.ln1(x))
        x = self.bias_dropout_add(out, bias, x)
        out, bias = self.mlp(self.ln2(x))
        return self.bias_dropout_add(out, bias, x)


def split_query_groups(num_attention_heads: int, num_kv_heads: int, tp_size: int) -> int:
    """Query groups (key/value heads) per TP rank; refuses a TP size that does not divide both head counts.

    Megatron-core splits the groups when the TP size divides them and, with fewer key/value heads than TP
    ranks, replicates them: each rank computes one whole group's k/v and keeps its share of the query heads
    (`num_query_groups < world_size` in Attention.__init__). The reference refuses that case instead:
    replicated k/v weights would be TP-replicated parameters whose gradients need their own sum over the
    ranks sharing a head, a second mechanism this block does not need to show the split. A TP size dividing
    neither is refused by Megatron too (its `divide` asserts).

    Mirrors `megatron-lm:megatron/core/transformer/attention.py::Attention.__init__`.
    """
    divide(num_attention_heads, tp_size, "num_attention_heads", by="the tensor-parallel size")
    if num_kv_heads < tp_size:
        raise ParallelConfigError(
            f"{num_kv_heads} key/value heads cannot be split over tensor-parallel size {tp_size}: each rank needs "
            f"a whole key/value head (Megatron replicates them instead; this reference does not), lower --tp"
        )
    return divide(num_kv_heads, tp_size, "num_kv_heads (key/value heads)", by="the tensor-parallel size")


class ParallelGroupedQueryAttention(torch.nn.Module):
    """QKV column-parallel (each rank gets num_kv_heads / p whole query groups, with their q/k/v biases),
    rotary + grouped-query attention on the local groups (`core_attention`, tensors in and out: the seam
    selective recompute checkpoints), output projection row-parallel without bias. Returns (output, None).

    Mirrors `megatron-lm:megatron/core/transformer/attention.py::SelfAttention.get_query_key_value_tensors`.
    """

    def __init__(
        self, hidden_size, num_attention_heads, num_kv_heads, linear_kwargs, rng=None, selective_recompute: bool = False
    ):
        super().__init__()
        self.rng, self.selective_recompute = rng, selective_recompute
        tp = linear_kwargs["tp_group"].size()
        self.local_query_groups = split_query_groups(num_attention_heads, num_kv_heads, tp)
        self.head_dim = divide(hidden_size, num_attention_heads, "hidden_size", by="num_attention_heads")
        qkv_size = (num_attention_heads + 2 * num_kv_heads) * self.head_dim
        self.qkv = ColumnParallelLinear(hidden_size, qkv_size, **linear_kwargs)
        self.proj = RowParallelLinear(
            num_attention_heads * self.head_dim, hidden_size, bias=False, input_is_parallel=True, **linear_kwargs
        )

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, None]:
        qkv, _ = self.qkv(x)
        return self.proj(_recomputed(self, self.selective_recompute, self.core_attention, qkv, *rotary))

    def core_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The local query groups' attention: what selective recompute checkpoints (tensors in, tensor out)."""
        return grouped_query_attention(qkv, self.head_dim, self.local_query_groups, cos, sin)


class ParallelSwiGLUMLP(torch.nn.Module):
    """fc1 [gate; up] column-parallel with stride 2 -> silu(gate) * up on the local columns -> fc2
    row-parallel (no biases). Returns (output, None). Megatron's MLP passes stride 2 to its fc1 under
    gated_linear_unit for the same reason.

    Mirrors `megatron-lm:megatron/core/transformer/mlp.py::MLP.__init__`.
    """

    def __init__(self, hidden_size, ffn_hidden_size, linear_kwargs):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden_size, 2 * ffn_hidden_size, bias=False, stride=2, **linear_kwargs)
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias=False, input_is_parallel=True, **linear_kwargs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        hidden, _ = self.fc1(x)
        return self.fc2(swiglu(hidden))


class ParallelLlamaBlock(ParallelBlock):
    """Pre-RMSNorm block: x + attention(ln1(x), rotary), then + mlp(ln2(x)), no dropout. `rotary` is the
    (cos, sin) of the whole sequence: attention runs on the gathered sequence even under SP. `shared`:
    ParallelBlock's keyword arguments, as for ParallelTransformerBlock (no dropout here, so the TP stream
    only keeps the two blocks' recomputation the same code)."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        *,
        tp_group: dist.ProcessGroup,
        num_kv_heads: int,
        ffn_hidden_size: int,
        norm_eps: float,
        **shared,
    ):
        super().__init__(
            tp_group=tp_group,
            norm=functools.partial(torch.nn.RMSNorm, hidden_size, eps=norm_eps),
            attention=lambda linear_kwargs, rng, selective: ParallelGroupedQueryAttention(
                hidden_size, num_attention_heads, num_kv_heads, linear_kwargs, rng, selective
            ),
            mlp=lambda linear_kwargs: ParallelSwiGLUMLP(hidden_size, ffn_hidden_size, linear_kwargs),
            **shared,
        )

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return super().forward(x, *rotary)

    def layer_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The layer itself: what full recompute checkpoints."""
        out, _ = self.attention(self.ln1(x), (cos, sin))
        x = x + out
        out, _ = self.mlp(self.ln2(x))
        return x + out


class ParallelTransformer(torch.nn.Module):
    """A stack of blocks taking and returning full [s, b, h] activations, replicated on the TP group.

    With sequence parallelism the input is split along the sequence on entry and gathered on exit. A
    sequence length that the TP size does not divide is an error, or, with pad_sequence=True, is padded with
    zeros at the end (causal attention keeps real tokens blind to the padding) and trimmed on exit.
    """

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        num_attention_heads: int,
        *,
        tp_group: dist.ProcessGroup,
        pad_sequence: bool = False,
        dropout_seed: int = 0,
        **block_kwargs,
    ):
        super().__init__()
        self.tp_group, self.pad_sequence = tp_group, pad_sequence
        rng = TensorParallelRNG(dropout_seed, tp_group, block_kwargs.get("device"))
        self.layers = torch.nn.ModuleList(
            ParallelTransformerBlock(hidden_size, num_attention_heads, tp_group=tp_group, rng=rng, **block_kwargs)
            for _ in range(num_layers)
        )
        self.sequence_parallel = bool(self.layers) and self.layers[0].sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_length, tp = x.shape[0], self.tp_group.size()
        if self.sequence_parallel:
            if seq_length % tp:
                if not self.pad_sequence:
                    raise ParallelConfigError(
                        f"sequence length {seq_length} is not divisible by the tensor-parallel size {tp}, "
                        "which sequence parallelism splits it by; pad it or pass pad_sequence=True"
                    )
                x = F.pad(x, (0, 0, 0, 0, 0, tp - seq_length % tp))
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        for layer in self.layers:
            x = layer(x)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=False)
        return x[:seq_length]

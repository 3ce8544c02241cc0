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
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.parallel_state import ParallelConfigError, divide
from reference.recompute import check_mode as check_recompute_mode, checkpoint
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from reference.tensor_parallel.random import TensorParallelRNG
from reference.tensor_parallel.unsharded import causal_self_attention, init_method_normal


class ParallelAttention(torch.nn.Module):
    """QKV column-parallel (each rank gets num_attention_heads / p whole heads), attention on the local
    heads, output projection row-parallel. Returns (output, bias) with the bias not yet added.
    With `selective_recompute` the attention core keeps only its input for backward (reference.recompute).

    Mirrors `megatron-lm:megatron/core/transformer/attention.py::SelfAttention`.
    """

    def __init__(self, hidden_size, num_attention_heads, attention_dropout, rng, linear_kwargs,
                 selective_recompute: bool = False):
        super().__init__()
        self.rng, self.selective_recompute = rng, selective_recompute
        divide(num_attention_heads, linear_kwargs["tp_group"].size(), "num_attention_heads")
        self.head_dim = divide(hidden_size, num_attention_heads, "hidden_size", by="num_attention_heads")
        self.attention_dropout = attention_dropout
        self.qkv = ColumnParallelLinear(hidden_size, 3 * hidden_size, **linear_kwargs)
        self.proj = RowParallelLinear(hidden_size, hidden_size, input_is_parallel=True, skip_bias_add=True,
                                      **linear_kwargs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, _ = self.qkv(x)
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            return self.proj(checkpoint(self.core_attention, self.rng, qkv))
        return self.proj(self.core_attention(qkv))

    def core_attention(self, qkv: torch.Tensor) -> torch.Tensor:
        """QK^T, softmax, dropout, x V on this rank's heads: the region selective recomputation re-runs."""
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
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, input_is_parallel=True, skip_bias_add=True,
                                     **linear_kwargs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, _ = self.fc1(x)
        return self.fc2(F.gelu(hidden))


class ParallelTransformerBlock(torch.nn.Module):
    """Pre-LayerNorm block: x + attention(ln1(x)), then + mlp(ln2(x)), the row biases added in the
    bias-dropout-add as Megatron does (hence skip_bias_add on the row layers). `recompute` (none, selective,
    full; reference.recompute) picks what the block keeps for backward while training."""

    def __init__(self, hidden_size: int, num_attention_heads: int, *, tp_group: dist.ProcessGroup,
                 ffn_hidden_size: int | None = None, init_method: Callable | None = None,
                 sequence_parallel: bool = False, hidden_dropout: float = 0.0, attention_dropout: float = 0.0,
                 async_grad_allreduce: bool = True, gradient_accumulation_fusion: bool = False,
                 params_dtype=torch.float32, device=None, rng: TensorParallelRNG | None = None,
                 recompute: str = "none"):
        super().__init__()
        self.recompute = check_recompute_mode(recompute)
        self.sequence_parallel = sequence_parallel and tp_group.size() > 1
        self.hidden_dropout = hidden_dropout
        self.rng = rng or TensorParallelRNG(0, tp_group, device)
        linear_kwargs = dict(tp_group=tp_group, init_method=init_method or init_method_normal(),
                             sequence_parallel=self.sequence_parallel, async_grad_allreduce=async_grad_allreduce,
                             gradient_accumulation_fusion=gradient_accumulation_fusion,
                             params_dtype=params_dtype, device=device)
        self.ln1 = torch.nn.LayerNorm(hidden_size, dtype=params_dtype, device=device)
        self.attention = ParallelAttention(hidden_size, num_attention_heads, attention_dropout, self.rng,
                                           linear_kwargs, selective_recompute=recompute == "selective")
        self.ln2 = torch.nn.LayerNorm(hidden_size, dtype=params_dtype, device=device)
        self.mlp = ParallelMLP(hidden_size, ffn_hidden_size or 4 * hidden_size, linear_kwargs)
        for param in [*self.ln1.parameters(), *self.ln2.parameters()]:
            param.sequence_parallel = self.sequence_parallel  # replicated, but sees only local tokens under SP

    def bias_dropout_add(self, out: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(out + bias); under SP each rank holds other tokens, so it draws its own mask."""
        split = self.sequence_parallel and self.training and self.hidden_dropout > 0
        with self.rng.fork() if split else contextlib.nullcontext():
            return residual + F.dropout(out + bias, self.hidden_dropout, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mirrors `megatron-lm:megatron/core/transformer/transformer_layer.py::TransformerLayer.forward`; with
        full recompute the whole layer runs again in backward (reference.recompute)."""
        if self.recompute == "full" and self.training and torch.is_grad_enabled():
            return checkpoint(self.layer_forward, self.rng, x)
        return self.layer_forward(x)

    def layer_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer itself: what full recompute checkpoints."""
        out, bias = self.attention(self.ln1(x))
        x = self.bias_dropout_add(out, bias, x)
        out, bias = self.mlp(self.ln2(x))
        return self.bias_dropout_add(out, bias, x)


class ParallelTransformer(torch.nn.Module):
    """A stack of blocks taking and returning full [s, b, h] activations, replicated on the TP group.

    With sequence parallelism the input is split along the sequence on entry and gathered on exit. A
    sequence length that the TP size does not divide is an error, or, with pad_sequence=True, is padded with
    zeros at the end (causal attention keeps real tokens blind to the padding) and trimmed on exit.
    """

    def __init__(self, num_layers: int, hidden_size: int, num_attention_heads: int, *,
                 tp_group: dist.ProcessGroup, pad_sequence: bool = False, dropout_seed: int = 0, **block_kwargs):
        super().__init__()
        self.tp_group, self.pad_sequence = tp_group, pad_sequence
        rng = TensorParallelRNG(dropout_seed, tp_group, block_kwargs.get("device"))
        self.layers = torch.nn.ModuleList(
            ParallelTransformerBlock(hidden_size, num_attention_heads, tp_group=tp_group, rng=rng, **block_kwargs)
            for _ in range(num_layers))
        self.sequence_parallel = bool(self.layers) and self.layers[0].sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_length, tp = x.shape[0], self.tp_group.size()
        if self.sequence_parallel:
            if seq_length % tp:
                if not self.pad_sequence:
                    raise ParallelConfigError(
                        f"sequence length {seq_length} is not divisible by the tensor-parallel size {tp}, "
                        "which sequence parallelism splits it by; pad it or pass pad_sequence=True")
                x = F.pad(x, (0, 0, 0, 0, 0, tp - seq_length % tp))
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        for layer in self.layers:
            x = layer(x)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=False)
        return x[:seq_length]

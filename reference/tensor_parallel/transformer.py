"""The transformer block, tensor-parallel: attention heads and MLP columns split across the TP group.

Per block and per direction, without sequence parallelism, exactly two all-reduces of a [s, b, h] tensor:
  forward:  attention output projection (row, g), MLP fc2 (row, g)
  backward: QKV input gradient (column, f),        MLP fc1 input gradient (column, f)
With sequence_parallel the activations outside attention/MLP (LayerNorm, dropout, residual) are split along
the sequence, and each all-reduce becomes its two halves: an all-gather before the column layer and a
reduce-scatter after the row layer (Korthikanti et al. 2022; megatron/core/transformer/ with
config.sequence_parallel). Backward additionally re-gathers each column layer's input (see linear_kernel).

Parameters are named and initialized exactly as in reference.tensor_parallel.unsharded, so after the same
seed each rank holds its slice of the unsharded model's weights.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.parallel_state import ParallelConfigError, divide
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from reference.tensor_parallel.unsharded import causal_self_attention, init_method_normal


class ParallelAttention(torch.nn.Module):
    """QKV column-parallel (each rank gets num_attention_heads / p whole heads), attention on the local
    heads, output projection row-parallel. Returns (output, bias) with the bias not yet added."""

    def __init__(self, hidden_size, num_attention_heads, attention_dropout, linear_kwargs):
        super().__init__()
        divide(num_attention_heads, linear_kwargs["tp_group"].size(), "num_attention_heads")
        self.head_dim = divide(hidden_size, num_attention_heads, "hidden_size", by="num_attention_heads")
        self.attention_dropout = attention_dropout
        self.qkv = ColumnParallelLinear(hidden_size, 3 * hidden_size, **linear_kwargs)
        self.proj = RowParallelLinear(hidden_size, hidden_size, input_is_parallel=True, skip_bias_add=True,
                                      **linear_kwargs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, _ = self.qkv(x)
        p = self.attention_dropout if self.training else 0.0
        return self.proj(causal_self_attention(qkv, self.head_dim, p))


class ParallelMLP(torch.nn.Module):
    """fc1 column-parallel -> GELU on the local columns -> fc2 row-parallel. Returns (output, bias)."""

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
    bias-dropout-add as Megatron does (hence skip_bias_add on the row layers)."""

    def __init__(self, hidden_size: int, num_attention_heads: int, *, tp_group: dist.ProcessGroup,
                 ffn_hidden_size: int | None = None, init_method: Callable | None = None,
                 sequence_parallel: bool = False, hidden_dropout: float = 0.0, attention_dropout: float = 0.0,
                 async_grad_allreduce: bool = True, gradient_accumulation_fusion: bool = False,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.sequence_parallel = sequence_parallel and tp_group.size() > 1
        self.hidden_dropout = hidden_dropout
        linear_kwargs = dict(tp_group=tp_group, init_method=init_method or init_method_normal(),
                             sequence_parallel=self.sequence_parallel, async_grad_allreduce=async_grad_allreduce,
                             gradient_accumulation_fusion=gradient_accumulation_fusion,
                             params_dtype=params_dtype, device=device)
        self.ln1 = torch.nn.LayerNorm(hidden_size, dtype=params_dtype, device=device)
        self.attention = ParallelAttention(hidden_size, num_attention_heads, attention_dropout, linear_kwargs)
        self.ln2 = torch.nn.LayerNorm(hidden_size, dtype=params_dtype, device=device)
        self.mlp = ParallelMLP(hidden_size, ffn_hidden_size or 4 * hidden_size, linear_kwargs)
        for param in [*self.ln1.parameters(), *self.ln2.parameters()]:
            param.sequence_parallel = self.sequence_parallel  # replicated, but sees only local tokens under SP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.attention(self.ln1(x))
        x = x + F.dropout(out + bias, self.hidden_dropout, self.training)
        out, bias = self.mlp(self.ln2(x))
        return x + F.dropout(out + bias, self.hidden_dropout, self.training)


class ParallelTransformer(torch.nn.Module):
    """A stack of blocks taking and returning full [s, b, h] activations, replicated on the TP group.

    With sequence parallelism the input is split along the sequence on entry and gathered on exit. A
    sequence length that the TP size does not divide is an error, or, with pad_sequence=True, is padded with
    zeros at the end (causal attention keeps real tokens blind to the padding) and trimmed on exit.
    """

    def __init__(self, num_layers: int, hidden_size: int, num_attention_heads: int, *,
                 tp_group: dist.ProcessGroup, pad_sequence: bool = False, **block_kwargs):
        super().__init__()
        self.tp_group, self.pad_sequence = tp_group, pad_sequence
        self.layers = torch.nn.ModuleList(
            ParallelTransformerBlock(hidden_size, num_attention_heads, tp_group=tp_group, **block_kwargs)
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

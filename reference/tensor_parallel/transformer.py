"""The transformer blocks in plain PyTorch, written once: no ranks, no process groups.

Unchanged, they are the unsharded oracle; reference.tensor_parallel.parallelize swaps their linears for
column/row-parallel ones, as picotron's apply_tensor_parallel does. Two styles: GPT-2 (LayerNorm, GELU MLP,
dropout) and Llama/Qwen2 (RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention). Activations are
[s, b, h]. The fused QKV is laid out group by group, [g, (q_1 .. q_{heads/g}, k, v), head_dim] (GPT-2: g =
heads), so a contiguous split gives each rank whole groups, as
`megatron-lm:megatron/core/transformer/attention.py::SelfAttention.get_query_key_value_tensors` reads it.

Each weight is an fp32 master drawn from the global RNG in Megatron's order, so a parallelized copy of the
same seed holds slices of the same weights. `rng` and `recompute` stay off here; parallelize sets them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from reference.context_parallel.ring_attention import ring_attention
from reference.parallel_state import divide
from reference.recompute import recomputed
from reference.tensor_parallel.rotary import apply_rotary


def init_method_normal(std: float = 0.02) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, std) in place (megatron/core/utils.py::init_method_normal)."""
    return partial(torch.nn.init.normal_, mean=0.0, std=std)


def _linear(
    in_features: int, out_features: int, init_method: Callable, dtype, device, bias: bool = True
) -> torch.nn.Linear:
    """nn.Linear whose weight is an fp32 master drawn by `init_method` (no default init drawing from the RNG),
    zero bias, as Megatron initializes its layers."""
    device = torch.get_default_device() if device is None else device  # skip_init would leave None on meta
    layer = torch.nn.utils.skip_init(torch.nn.Linear, in_features, out_features, bias=bias, dtype=dtype, device=device)
    with torch.no_grad():
        master = torch.empty(out_features, in_features, dtype=torch.float32)
        init_method(master)
        layer.weight.copy_(master)
        if bias:
            layer.bias.zero_()
    return layer


def _on(rng, draws: bool):
    """Run on `rng`'s stream when it is set and the block draws random numbers, else on the default one."""
    return rng.fork() if rng is not None and draws else contextlib.nullcontext()


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group=None, **sdpa) -> torch.Tensor:
    """Causal SDPA on [b, heads, s, d], or, given a context-parallel group, ring attention over its ranks'
    head-tail shards of the sequence (key/value heads repeated for their query groups)."""
    if cp_group is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **sdpa)
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return ring_attention(q, k, v, cp_group)


def causal_self_attention(qkv: torch.Tensor, head_dim: int, dropout_p: float, cp_group=None) -> torch.Tensor:
    """[s, b, heads * 3 * head_dim] fused projections -> [s, b, heads * head_dim] causal attention output (GPT-2).

    The head count is read from the shape, so the same code runs on all heads or on one rank's share.
    """
    s, b = qkv.shape[:2]
    q, k, v = qkv.view(s, b, -1, 3, head_dim).permute(3, 1, 2, 0, 4).unbind(0)  # each [b, heads, s, d]
    context = causal(q, k, v, cp_group, dropout_p=dropout_p)
    return context.permute(2, 0, 1, 3).reshape(s, b, -1)


def grouped_query_attention(
    qkv: torch.Tensor, head_dim: int, queries_per_group: int, cos: torch.Tensor, sin: torch.Tensor, cp_group=None
) -> torch.Tensor:
    """[s, b, groups * (queries_per_group + 2) * head_dim] fused projections -> [s, b, heads * head_dim]:
    rotary positions on q and k, then causal attention, each key/value head serving its group's query heads
    (Llama/Qwen2). The group count is read from the shape: all groups, or one rank's share.
    """
    s, b = qkv.shape[:2]
    grouped = qkv.view(s, b, -1, queries_per_group + 2, head_dim)  # [s, b, g, heads/g + 2, d]
    q, k, v = grouped[:, :, :, :-2], grouped[:, :, :, -2:-1], grouped[:, :, :, -1:]
    q, k, v = (t.flatten(2, 3).permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads or g, s, d]
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    context = causal(q, k, v, cp_group, enable_gqa=True)
    return context.permute(2, 0, 1, 3).reshape(s, b, -1)


class Attention(torch.nn.Module):
    """Fused QKV, attention per head (grouped when num_kv_heads < heads, rotary when given), output projection.
    GPT-2: all biased, dropout on the probabilities. Llama/Qwen2 (`qkv_only_bias`): q/k/v biased (Qwen2; with
    `qkv_bias` False none, as Llama 3), proj not.

    Mirrors `megatron-lm:megatron/core/transformer/attention.py::SelfAttention`.
    """

    def __init__(
        self,
        hidden_size,
        num_attention_heads,
        init_method,
        *,
        num_kv_heads=None,
        dropout=0.0,
        qkv_only_bias=False,
        qkv_bias=True,
        **kw,
    ):
        super().__init__()
        groups = num_kv_heads or num_attention_heads
        self.head_dim = divide(hidden_size, num_attention_heads, "hidden_size", by="num_attention_heads")
        self.queries_per_group = num_attention_heads // groups
        self.attention_dropout = dropout
        qkv_size = (num_attention_heads + 2 * groups) * self.head_dim
        self.qkv = _linear(hidden_size, qkv_size, init_method, bias=qkv_bias, **kw)
        heads_size = num_attention_heads * self.head_dim
        self.proj = _linear(heads_size, hidden_size, init_method, bias=not qkv_only_bias, **kw)
        self.rng, self.recompute = None, False  # set by parallelize: head-split dropout stream, selective recompute
        self.cp_group = None  # set by parallelize: the ring of context-parallel ranks holding the sequence

    def forward(self, x: torch.Tensor, *rotary: torch.Tensor) -> torch.Tensor:
        selective = self.recompute and self.training
        return self.proj(recomputed(selective, self.rng, self.core_attention, self.qkv(x), *rotary))

    def core_attention(self, qkv: torch.Tensor, *rotary: torch.Tensor) -> torch.Tensor:
        """QK^T, softmax, dropout, x V on the heads this module holds: the region selective recompute re-runs.

        Mirrors `megatron-lm:megatron/core/transformer/attention.py::Attention._checkpointed_attention_forward`.
        """
        if rotary:  # Llama/Qwen2: no dropout
            return grouped_query_attention(qkv, self.head_dim, self.queries_per_group, *rotary, self.cp_group)
        p = self.attention_dropout if self.training else 0.0
        with _on(self.rng, p > 0):  # each rank's heads draw their own masks
            return causal_self_attention(qkv, self.head_dim, p, self.cp_group)


def swiglu(fc1_output: torch.Tensor) -> torch.Tensor:
    """[..., 2 f] = (gate, up) -> silu(gate) * up [..., f] (Shazeer 2020; Megatron's glu with F.silu)."""
    gate, up = fc1_output.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(torch.nn.Module):
    """fc1 -> GELU -> fc2 (GPT-2, biased), or fc1 = [gate; up] -> silu(gate) * up -> fc2 (`gated`: SwiGLU,
    no biases). `bias` overrides that default (a MoE layer's experts have none).

    Mirrors `megatron-lm:megatron/core/transformer/mlp.py::MLP.forward`.
    """

    def __init__(self, hidden_size, ffn_hidden_size, init_method, *, gated=False, bias=None, **kw):
        super().__init__()
        self.gated, bias = gated, not gated if bias is None else bias
        self.fc1 = _linear(hidden_size, (1 + gated) * ffn_hidden_size, init_method, bias=bias, **kw)
        self.fc2 = _linear(ffn_hidden_size, hidden_size, init_method, bias=bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)
        return self.fc2(swiglu(hidden) if self.gated else F.gelu(hidden))


class Block(torch.nn.Module):
    """Pre-norm block: x + drop(attention(ln1(x))), then + drop(mlp(ln2(x))); `*rotary` passes Llama's (cos, sin).

    `recompute` "full" re-runs the whole layer in backward (reference.recompute). `rng` is the dropout stream
    of activations split over ranks, and `sequence_parallel` says the residual stream is: both set by
    parallelize."""

    def __init__(self, norm: Callable, attention: Attention, mlp: MLP, hidden_dropout: float, dtype, device):
        super().__init__()
        self.ln1, self.attention = norm(dtype=dtype, device=device), attention
        self.ln2, self.mlp = norm(dtype=dtype, device=device), mlp
        self.hidden_dropout = hidden_dropout
        self.rng, self.recompute, self.sequence_parallel = None, "none", False

    def forward(self, x: torch.Tensor, *rotary: torch.Tensor) -> torch.Tensor:
        """layer_forward, under full recompute re-run in backward, as
        `megatron-lm:megatron/core/transformer/transformer_block.py::TransformerBlock._checkpointed_forward`
        does."""
        full = self.recompute == "full" and self.training
        return recomputed(full, self.rng, self.layer_forward, x, *rotary)

    def layer_forward(self, x: torch.Tensor, *rotary: torch.Tensor) -> torch.Tensor:
        """Mirrors `megatron-lm:megatron/core/transformer/transformer_layer.py::TransformerLayer.forward`."""
        x = self.dropout_add(self.attention(self.ln1(x), *rotary), x)
        return self.dropout_add(self.mlp(self.ln2(x)), x)

    def dropout_add(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(out); under sequence parallelism each rank holds other tokens: its own masks."""
        if not self.hidden_dropout:
            return residual + out
        with _on(self.rng, self.sequence_parallel and self.training):
            return residual + F.dropout(out, self.hidden_dropout, self.training)


class TransformerBlock(Block):
    """The GPT-2 block: LayerNorm, multi-head attention and a GELU MLP, all biased; dropout on each branch."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        *,
        ffn_hidden_size: int | None = None,
        init_method: Callable | None = None,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        params_dtype=torch.float32,
        device=None,
    ):
        init, kw = init_method or init_method_normal(), dict(dtype=params_dtype, device=device)
        super().__init__(
            partial(torch.nn.LayerNorm, hidden_size),
            Attention(hidden_size, num_attention_heads, init, dropout=attention_dropout, **kw),
            MLP(hidden_size, ffn_hidden_size or 4 * hidden_size, init, **kw),
            hidden_dropout,
            **kw,
        )


class LlamaBlock(Block):
    """The Llama/Qwen2 block: RMSNorm, grouped-query attention with rotary positions, SwiGLU; no dropout. q/k/v
    biased as Qwen2's, or (`qkv_bias` False) bias-free as Llama 3's."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        *,
        num_kv_heads: int,
        ffn_hidden_size: int,
        norm_eps: float,
        qkv_bias: bool = True,
        init_method: Callable | None = None,
        params_dtype=torch.float32,
        device=None,
    ):
        init, kw = init_method or init_method_normal(), dict(dtype=params_dtype, device=device)
        super().__init__(
            partial(torch.nn.RMSNorm, hidden_size, eps=norm_eps),
            Attention(
                hidden_size,
                num_attention_heads,
                init,
                num_kv_heads=num_kv_heads,
                qkv_only_bias=True,
                qkv_bias=qkv_bias,
                **kw,
            ),
            MLP(hidden_size, ffn_hidden_size, init, gated=True, **kw),
            0.0,
            **kw,
        )

"""The transformer block in plain PyTorch: the oracle for the tests and the model DTensor parallelizes.

Same math, same parameter names and shapes as the full (unsplit) weights of
reference.tensor_parallel.transformer, and the same initialization order, so that after the same seed the
two hold the same master weights. Activations are [s, b, h] (sequence first), as in Megatron.
The QKV projection is fused and laid out head by head, [heads, (q, k, v), head_dim] along its output
features, so that a contiguous split of those features gives each rank whole heads (Megatron's layout).

The Llama/Qwen2 block (LlamaBlock) groups the heads instead: g = num_kv_heads query groups, each of
heads / g query heads sharing one key and one value head, laid out [g, (q_1 .. q_{heads/g}, k, v), head_dim]
(megatron/core/transformer/attention.py::SelfAttention.get_query_key_value_tensors splits it so), so a
contiguous split gives each rank whole groups. Its MLP's fused fc1 is [gate; up], split with stride 2.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from reference.tensor_parallel.rotary import apply_rotary


def init_method_normal(std: float = 0.02) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, std) in place (megatron/core/utils.py::init_method_normal)."""
    return partial(torch.nn.init.normal_, mean=0.0, std=std)


def causal_self_attention(qkv: torch.Tensor, head_dim: int, dropout_p: float) -> torch.Tensor:
    """[s, b, heads * 3 * head_dim] fused projections -> [s, b, heads * head_dim] causal attention output.

    The head count is inferred, so the same code runs on all heads or on one rank's share of them.
    """
    s, b = qkv.shape[:2]
    q, k, v = qkv.view(s, b, -1, 3, head_dim).permute(3, 1, 2, 0, 4).unbind(0)  # each [b, heads, s, d]
    context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return context.permute(2, 0, 1, 3).reshape(s, b, -1)


def _linear(
    in_features: int, out_features: int, init_method: Callable, dtype, device, bias: bool = True
) -> torch.nn.Linear:
    """nn.Linear whose weight comes from `init_method` (no default init drawing from the RNG), zero bias."""
    layer = torch.nn.utils.skip_init(torch.nn.Linear, in_features, out_features, bias=bias, dtype=dtype, device=device)
    with torch.no_grad():
        master = torch.empty(out_features, in_features, dtype=torch.float32)
        init_method(master)
        layer.weight.copy_(master)
        if bias:
            layer.bias.zero_()
    return layer


class Attention(torch.nn.Module):
    """Causal self-attention: fused QKV projection, attention per head, output projection."""

    def __init__(self, hidden_size, num_attention_heads, init_method, attention_dropout, **kw):
        super().__init__()
        self.head_dim, self.attention_dropout = hidden_size // num_attention_heads, attention_dropout
        self.qkv = _linear(hidden_size, 3 * hidden_size, init_method, **kw)
        self.proj = _linear(hidden_size, hidden_size, init_method, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.attention_dropout if self.training else 0.0
        return self.proj(causal_self_attention(self.qkv(x), self.head_dim, p))


class MLP(torch.nn.Module):
    """fc1 -> GELU -> fc2."""

    def __init__(self, hidden_size, ffn_hidden_size, init_method, **kw):
        super().__init__()
        self.fc1 = _linear(hidden_size, ffn_hidden_size, init_method, **kw)
        self.fc2 = _linear(ffn_hidden_size, hidden_size, init_method, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerBlock(torch.nn.Module):
    """Pre-LayerNorm block: x + attention(ln1(x)), then + mlp(ln2(x)); dropout on each branch's output."""

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
        super().__init__()
        init_method = init_method or init_method_normal()
        kw = dict(dtype=params_dtype, device=device)
        self.hidden_dropout = hidden_dropout
        self.ln1 = torch.nn.LayerNorm(hidden_size, **kw)
        self.attention = Attention(hidden_size, num_attention_heads, init_method, attention_dropout, **kw)
        self.ln2 = torch.nn.LayerNorm(hidden_size, **kw)
        self.mlp = MLP(hidden_size, ffn_hidden_size or 4 * hidden_size, init_method, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attention(self.ln1(x)), self.hidden_dropout, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.hidden_dropout, self.training)


def grouped_query_attention(
    qkv: torch.Tensor, head_dim: int, num_query_groups: int, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """[s, b, groups * (heads/groups + 2) * head_dim] fused projections -> [s, b, heads * head_dim]: rotary
    positions on q and k, then causal attention, each key/value head serving its group's query heads.

    `num_query_groups` is the number of groups this call sees (all of them, or one TP rank's share): the
    core-attention callable of the Llama block, as causal_self_attention is the GPT-2 block's.
    """
    s, b = qkv.shape[:2]
    grouped = qkv.view(s, b, num_query_groups, -1, head_dim)  # [s, b, g, heads/g + 2, d]
    q, k, v = grouped[:, :, :, :-2], grouped[:, :, :, -2:-1], grouped[:, :, :, -1:]
    q, k, v = (t.flatten(2, 3).permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads or g, s, d]
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    context = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return context.permute(2, 0, 1, 3).reshape(s, b, -1)


class GroupedQueryAttention(torch.nn.Module):
    """Fused QKV with biases (Qwen2: q/k/v biased, the output projection not), rotary positions, grouped-query
    attention, output projection."""

    def __init__(self, hidden_size, num_attention_heads, num_kv_heads, init_method, **kw):
        super().__init__()
        self.head_dim, self.num_kv_heads = hidden_size // num_attention_heads, num_kv_heads
        qkv_size = (num_attention_heads + 2 * num_kv_heads) * self.head_dim
        self.qkv = _linear(hidden_size, qkv_size, init_method, **kw)
        self.proj = _linear(num_attention_heads * self.head_dim, hidden_size, init_method, bias=False, **kw)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.proj(grouped_query_attention(self.qkv(x), self.head_dim, self.num_kv_heads, *rotary))


def swiglu(fc1_output: torch.Tensor) -> torch.Tensor:
    """[..., 2 f] = (gate, up) -> silu(gate) * up [..., f] (Shazeer 2020; Megatron's glu with F.silu)."""
    gate, up = fc1_output.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLUMLP(torch.nn.Module):
    """fc1 = [gate; up] (no bias) -> silu(gate) * up -> fc2 (no bias)."""

    def __init__(self, hidden_size, ffn_hidden_size, init_method, **kw):
        super().__init__()
        self.fc1 = _linear(hidden_size, 2 * ffn_hidden_size, init_method, bias=False, **kw)
        self.fc2 = _linear(ffn_hidden_size, hidden_size, init_method, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(swiglu(self.fc1(x)))


class LlamaBlock(torch.nn.Module):
    """Pre-RMSNorm block: x + attention(ln1(x), rotary), then + mlp(ln2(x)); no dropout (Llama, Qwen2)."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        *,
        num_kv_heads: int,
        ffn_hidden_size: int,
        norm_eps: float,
        init_method: Callable | None = None,
        params_dtype=torch.float32,
        device=None,
    ):
        super().__init__()
        init_method = init_method or init_method_normal()
        kw = dict(dtype=params_dtype, device=device)
        self.ln1 = torch.nn.RMSNorm(hidden_size, eps=norm_eps, **kw)
        self.attention = GroupedQueryAttention(hidden_size, num_attention_heads, num_kv_heads, init_method, **kw)
        self.ln2 = torch.nn.RMSNorm(hidden_size, eps=norm_eps, **kw)
        self.mlp = SwiGLUMLP(hidden_size, ffn_hidden_size, init_method, **kw)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attention(self.ln1(x), rotary)
        return x + self.mlp(self.ln2(x))


class Transformer(torch.nn.Module):
    """A stack of blocks (no embedding or head: the demo feeds random hidden states)."""

    def __init__(self, num_layers: int, hidden_size: int, num_attention_heads: int, **kwargs):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            TransformerBlock(hidden_size, num_attention_heads, **kwargs) for _ in range(num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

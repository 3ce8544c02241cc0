"""Rotary position embeddings (RoPE), in the half-rotation layout Hugging Face Llama/Qwen2 use.

Each head's vector of size d is read as two halves (x1, x2) = (x[:d/2], x[d/2:]); position t rotates the pair
(x1[i], x2[i]) by the angle t * theta^(-2i/d). So q.k depends only on the distance between the two positions,
and nothing is learned. The angles depend on the position alone, never on the tokens: under sequence
parallelism the attention runs on the gathered sequence, so every rank uses the cos/sin of the whole sequence
(positions 0..s-1; a padded sequence continues them, and causal attention keeps real tokens blind to the pad).

Counterparts: transformers/models/qwen2/modeling_qwen2.py (`Qwen2RotaryEmbedding`, `rotate_half`,
`apply_rotary_pos_emb`: transformers is the oracle here, not a pinned source) and, in Megatron-core,
megatron/core/models/common/embeddings/rotary_pos_embedding.py::RotaryEmbedding with rotary_interleaved=False.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=32)
def rotary_cos_sin(seq_length: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [s, d] of positions 0..s-1, computed in fp32 (the caller casts to the activation dtype).

    Built once per (length, size, base, device) and shared: the tables depend on the positions alone, so every
    forward of every stage and of the unsharded model reuses them, as Megatron caches its tables (an lru_cache
    of 32 on `megatron-lm:megatron/core/models/common/embeddings/rotary_pos_embedding.py::RotaryEmbedding.forward`).
    Nobody may change them in place."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # the same angle for x1[i] and x2[i]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d] rotated by position: x cos + rotate_half(x) sin, rotate_half(x1, x2) = (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)

"""The all-to-all form (DeepSpeed-Ulysses): trade sequence shards for head shards, attend, trade back.

Before attention each rank holds s/cp tokens of every head; one all-to-all gives it all s tokens of heads/cp
heads, plain causal attention runs on them, and a second all-to-all returns [s/cp tokens, all heads]. Volume per
rank stays constant as cp grows with s; the limit is the heads: cp must divide them (and, for grouped-query
attention, the key/value heads), refused in one line. The received tokens arrive rank by rank in head-tail order;
a mask by position makes them causal without reordering.

Mirrors `pytorch:torch/distributed/tensor/experimental/_context_parallel/_attention.py::_AllToAllRotater`'s
collective, used here as Ulysses uses it (Jacobs et al. 2023), not to rotate a ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.context_parallel.load_balance import positions
from reference.moe.mappings import all_to_all
from reference.parallel_state import ParallelConfigError


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, split_dim: int, cat_dim: int) -> torch.Tensor:
    """Split `x` into cp pieces along `split_dim`, send piece j to rank j, concatenate what arrives along
    `cat_dim` (rank order). Backward is the reverse exchange (reference.moe.mappings.all_to_all)."""
    cp = group.size()
    pieces = torch.stack(x.chunk(cp, dim=split_dim))  # [cp, ...]: row j goes to rank j
    shape = pieces.shape[1:]
    received = all_to_all(pieces.reshape(cp, -1), group, [1] * cp, [1] * cp).view(cp, *shape)
    return torch.cat(received.unbind(0), dim=cat_dim)


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, balanced: bool = True
) -> torch.Tensor:
    """Causal attention of this rank's tokens [b, heads, s/cp, d], computed as heads/cp heads over all tokens."""
    cp = group.size()
    for name, t in (("attention heads", q), ("key/value heads", k)):
        if t.shape[1] % cp:
            raise ParallelConfigError(f"Ulysses splits heads over cp: {t.shape[1]} {name} do not divide by cp {cp}")
    q, k, v = (_exchange(t, group, split_dim=1, cat_dim=2) for t in (q, k, v))  # [b, heads/cp, s, d]
    at = torch.cat([positions(q.shape[2], r, cp, balanced, device=q.device) for r in range(cp)])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=at[None, :] <= at[:, None], enable_gqa=True)
    return _exchange(out, group, split_dim=2, cat_dim=1)  # back to [b, heads, s/cp, d]

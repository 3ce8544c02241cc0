"""The all-gather form (Llama 3's context parallelism): gather every rank's K/V, attend with the local queries.

One all-gather of K/V over cp replaces the ring's cp - 1 exchanges; its backward reduce-scatters dK/dV, each
rank's queries having contributed to every rank's keys. The gathered keys arrive rank by rank, each rank's
chunks in its own (head-tail) order; attention needs no reordering, only a mask by position: query at p sees
key at p' iff p' <= p. It holds the whole sequence's K/V per rank (memory cp times the ring's), cheap for
grouped-query attention, where K/V are few heads (Llama 3: 8 of 128).

Mirrors `pytorch:torch/distributed/tensor/experimental/_context_parallel/_attention.py::_AllGatherRotater`
(torch's default rotation: one all-gather, then each ring step takes its rank's slice).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.context_parallel.load_balance import positions
from reference.tensor_parallel.mappings import gather_from_sequence_parallel_region


def all_gather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, balanced: bool = True
) -> torch.Tensor:
    """Causal attention of this rank's queries [b, heads, s/cp, d] over the gathered K/V of every rank."""
    rank, cp, local = group.rank(), group.size(), q.shape[2]
    kv = torch.stack([k, v]).movedim(3, 0)  # [s/cp, 2, b, heads, d]: the sequence first, for the gather
    keys, values = gather_from_sequence_parallel_region(kv, group).movedim(0, 3).unbind(0)  # backward: reduce-scatter
    seq = local * cp
    query_at = positions(seq, rank, cp, balanced, device=q.device)
    key_at = torch.cat([positions(seq, r, cp, balanced, device=q.device) for r in range(cp)])
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=key_at[None, :] <= query_at[:, None])

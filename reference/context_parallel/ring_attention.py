"""Ring attention: K/V travel around the cp ring, each rank's queries stay, partial outputs merge by log-sum-exp.

At step i rank r holds the K/V of rank (r - i) mod cp. It sends them on to r + 1 and receives the next from
r - 1 (one batched isend/irecv, in flight while the step computes), attends its query chunks to them block by
block (full, masked or skipped: reference.context_parallel.load_balance.block_kind) and merges each block into
the running output by its log-sum-exp (reference.context_parallel.blocks.merge). After cp steps every query has
met every key, with cp - 1 exchanges. Backward goes round again: K/V travel with the dK/dV accumulated for their
owner so far, each rank adds its blocks' share, and one last hop returns dK/dV home.

Balanced or not is only which chunks a rank holds (load_balance.held_chunks): the same loop handles both, as
`pytorch:torch/distributed/tensor/experimental/_context_parallel/_attention.py::_templated_ring_attention` and
`pytorch:torch/distributed/tensor/experimental/_context_parallel/_attention.py::_templated_ring_attention_backward`
do with their three per-step cases.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from reference.context_parallel.blocks import accumulating, attend, attend_backward, merge
from reference.context_parallel.load_balance import block_kind, held_chunks


class _RingPass:
    """Tensors sent to the next rank of the ring while the previous rank's arrive; `wait()` returns them."""

    def __init__(self, tensors: list[torch.Tensor], group: dist.ProcessGroup):
        rank, size = group.rank(), group.size()
        self.shapes = [t.shape for t in tensors]
        # one flat buffer: contiguous, one message (torch: "without making key and value contiguous(), the loss
        # curve is bad")
        flat = torch.cat([t.contiguous().flatten() for t in tensors])
        self.received = torch.empty_like(flat)
        self.works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, flat, dist.get_global_rank(group, (rank + 1) % size), group),
                dist.P2POp(dist.irecv, self.received, dist.get_global_rank(group, (rank - 1) % size), group),
            ]
        )

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        sizes = [s.numel() for s in self.shapes]
        return [t.view(s) for t, s in zip(self.received.split(sizes), self.shapes)]


def _blocks(rank: int, step: int, cp: int, balanced: bool):
    """(query chunk index, key chunk index, masked) of the blocks rank computes at `step`, indices local."""
    mine, theirs = held_chunks(rank, cp, balanced), held_chunks((rank - step) % cp, cp, balanced)
    for (qi, q), (ki, k) in itertools.product(enumerate(mine), enumerate(theirs)):
        if block_kind(q, k) != "skipped":
            yield qi, ki, block_kind(q, k) == "masked"


class _RingAttention(torch.autograd.Function):
    """Forward: cp steps of attend-and-merge while K/V rotate; backward: cp steps while K/V and dK/dV rotate."""

    @staticmethod
    def forward(ctx, q, k, v, group, balanced, observer):
        rank, cp, n = group.rank(), group.size(), len(held_chunks(0, group.size(), balanced))
        scale = q.shape[-1] ** -0.5
        qs = q.chunk(n, dim=2)
        out, lse = [None] * n, [None] * n  # per query chunk, merged over the blocks met so far
        key, value = k, v
        for step in range(cp):
            ring = _RingPass([key, value], group) if step < cp - 1 else None
            ks, vs = key.chunk(n, dim=2), value.chunk(n, dim=2)
            blocks = list(_blocks(rank, step, cp, balanced))
            if observer is not None:  # measurement attaches here (reference.measure.cp_blocks), computes nothing
                observer(step, qs, ks, blocks)
            for qi, ki, masked in blocks:
                block = attend(qs[qi], ks[ki], vs[ki], masked, scale)
                out[qi], lse[qi] = block if out[qi] is None else merge(out[qi], lse[qi], *block)
            if ring is not None:
                key, value = ring.wait()
        out, lse = torch.cat(out, dim=2), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.balanced, ctx.scale = group, balanced, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, balanced, scale = ctx.group, ctx.balanced, ctx.scale
        rank, cp, n = group.rank(), group.size(), len(held_chunks(0, group.size(), balanced))
        qs, outs, lses, grads = (t.chunk(n, dim=2) for t in (q, out, lse, accumulating(grad_out)))
        grad_q = torch.zeros_like(accumulating(q))
        key, value = k, v
        grad_key, grad_value = torch.zeros_like(accumulating(k)), torch.zeros_like(accumulating(v))
        for step in range(cp):
            ks, vs = key.chunk(n, dim=2), value.chunk(n, dim=2)
            dqs, dks, dvs = (t.chunk(n, dim=2) for t in (grad_q, grad_key, grad_value))  # views, added to in place
            for qi, ki, masked in _blocks(rank, step, cp, balanced):
                dq, dk, dv = attend_backward(qs[qi], ks[ki], vs[ki], outs[qi], lses[qi], grads[qi], masked, scale)
                dqs[qi].add_(dq)
                dks[ki].add_(dk)
                dvs[ki].add_(dv)
            if step < cp - 1:  # K/V and their gradients so far, on to the next rank
                key, value, grad_key, grad_value = _RingPass([key, value, grad_key, grad_value], group).wait()
        if cp > 1:  # the accumulators belong to rank + 1: one last hop home
            grad_key, grad_value = _RingPass([grad_key, grad_value], group).wait()
        dtype = q.dtype
        return grad_q.to(dtype), grad_key.to(dtype), grad_value.to(dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    balanced: bool = True,
    observer=None,
) -> torch.Tensor:
    """Causal attention of this rank's queries [b, heads, s/cp, d] over the whole sequence's keys, the shards
    laid out by reference.context_parallel.load_balance.shard (head-tail when `balanced`). `observer`, if
    given, is called at each forward ring step as observer(step, query chunks, key chunks held, blocks), the
    blocks (query chunk index, key chunk index, masked) that step computes, before it computes them."""
    return _RingAttention.apply(q, k, v, group, balanced, observer)

"""One block of attention and its gradients: what every context-parallel form computes per block.

A block is this rank's query chunk against one key/value chunk, "full" or "masked" (causal on the diagonal;
reference.context_parallel.load_balance.block_kind). Forward returns the block's output and the log-sum-exp of
its scores, so that blocks seen one after another merge exactly: softmax over the union of their keys. Backward
is flash attention's, from the saved merged output and log-sum-exp: P = exp(S - lse), dV = P^T dO,
dS = P (dO V^T - rowsum(dO O)), dQ = dS K, dK = dS^T Q (times the softmax scale). Everything in fp32 (or
wider), as torch's ring accumulates (`_cp_options.convert_to_f32`).

`by_hand` and `backward_by_hand` write those formulas out; `attend` and `attend_backward` run them as the fused
kernel where the device has one that returns the log-sum-exp (the CPU's flash attention, the op torch's ring
calls per step there), else by hand. The kernel computes the same numbers without materializing the scores.

Mirrors `pytorch:torch/distributed/tensor/experimental/_context_parallel/_attention.py::_SDPAMerger._merge_one`.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def accumulating(t: torch.Tensor) -> torch.Tensor:
    """`t` in the accumulation dtype: fp32, or wider where it already is (fp64 tests exactly)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q: torch.Tensor, k: torch.Tensor, masked: bool, scale: float) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * scale
    if masked:  # the diagonal block: query i sees keys 0..i of the chunk
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool, scale: float):
    """(out, lse) of one block: softmax(q k^T scale) v over these keys alone, and the log-sum-exp of its rows."""
    scores = _scores(accumulating(q), accumulating(k), masked, scale)
    lse = scores.logsumexp(dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ accumulating(v), lse


def backward_by_hand(q, k, v, out, lse, grad_out, masked: bool, scale: float):
    """(dq, dk, dv) of one block, given the merged `out` and `lse` of q's rows over all their keys."""
    q, k, v = accumulating(q), accumulating(k), accumulating(v)
    p = torch.exp(_scores(q, k, masked, scale) - lse)  # this block's share of the whole softmax
    grad_v = p.transpose(-2, -1) @ grad_out
    delta = (grad_out * out).sum(dim=-1, keepdim=True)
    grad_scores = p * (grad_out @ v.transpose(-2, -1) - delta)
    return (grad_scores @ k) * scale, (grad_scores.transpose(-2, -1) @ q) * scale, grad_v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool, scale: float):
    """`by_hand`'s (out, lse [..., 1]), by the device's fused kernel where it has one."""
    if q.device.type != "cpu":
        return by_hand(q, k, v, masked, scale)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        accumulating(q), accumulating(k), accumulating(v), 0.0, masked, scale=scale
    )
    return out, lse.unsqueeze(-1)


def attend_backward(q, k, v, out, lse, grad_out, masked: bool, scale: float):
    """`backward_by_hand`'s (dq, dk, dv), by the device's fused kernel where it has one."""
    if q.device.type != "cpu":
        return backward_by_hand(q, k, v, out, lse, grad_out, masked, scale)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out,
        accumulating(q),
        accumulating(k),
        accumulating(v),
        out,
        lse.squeeze(-1).contiguous(),
        0.0,
        masked,
        scale=scale,
    )


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Two partial softmaxes as one: each output weighted by its share exp(lse_i - lse) of the merged
    normalizer lse = log(e^lse_1 + e^lse_2) (an empty start is out 0, lse -inf)."""
    merged = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - merged) + block_out * torch.exp(block_lse - merged), merged

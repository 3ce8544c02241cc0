"""torch's ring attention as the ring benchmark and the upstream tests run it on the CPU: forward and backward
by `_templated_ring_attention` and `_templated_ring_attention_backward`, with the CPU flash-attention kernel
(which returns the output and its log-sum-exp) and its backward as the per-block op, under torch's
module-level `_cp_options`."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed import ProcessGroup
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@contextlib.contextmanager
def cp_options(**options):
    """torch's module-level `_cp_options` (enable_load_balance, rotate_method, ...) set for the body, restored
    after."""
    saved = {name: getattr(torch_cp._cp_options, name) for name in options}
    for name, value in options.items():
        setattr(torch_cp._cp_options, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch_cp._cp_options, name, value)


def torch_ring_attention(group: ProcessGroup, q, k, v, grad_out) -> tuple[torch.Tensor, ...]:
    """torch's causal ring attention of this rank's shards [b, heads, s/cp, d], forward then backward from
    `grad_out`: (out, dq, dk, dv). The shards must be laid out as `_cp_options.enable_load_balance` says."""
    out, lse, *_ = torch_cp._templated_ring_attention(group, 2, FLASH, q, k, v, is_causal=True)
    grads = torch_cp._templated_ring_attention_backward(
        group, 2, FLASH_BACKWARD, grad_out, "grad_out", q, k, v, out, lse, is_causal=True, dropout_p=0.0
    )
    return out, *grads[:3]

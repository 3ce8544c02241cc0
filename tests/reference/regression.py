"""The regression task the data-parallel tests train the GPT blocks on (helpers.gpt_blocks), and its oracle.

Random [s, b, h] inputs and targets (the same on every rank), the mean squared error, and the single-process
model trained on the whole global batch: what DDP, FSDP x TP and the distributed optimizer must reproduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference.gpt.model import gpt_blocks
from tests.reference.helpers import UnshardedRun, sgd_steps


def batches(steps: int, s: int, b: int, h: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` (input, target) pairs of shape [s, b, h] from a fixed seed: every rank draws the same."""
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(s, b, h, generator=g), torch.randn(s, b, h, generator=g)) for _ in range(steps)]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over the local batch: the mean over DP ranks of equal slices is the global-batch mean."""
    return ((out - target) ** 2).mean()


def mean_over(value: float, group) -> float:
    """The mean of `value` over the ranks of `group` (in float64, so the global-batch loss is not rounded)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / group.size()


def single_process(
    layers: int, h: int, heads: int, seed: int, lr: float, data: list[tuple[torch.Tensor, torch.Tensor]]
) -> UnshardedRun:
    """Losses, step-1 gradients and final parameters of the unsharded GPT blocks after an SGD step per batch
    of `data`, on the CPU."""
    torch.manual_seed(seed)
    model = gpt_blocks(layers, h, heads, device=torch.device("cpu"))
    return sgd_steps(model, data, lambda model, batch: mse(model(None, None, hidden=batch[0]), batch[1]), lr)

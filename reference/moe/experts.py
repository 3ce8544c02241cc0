"""The experts: one MLP module each, run one after another on its contiguous block of rows.

The unsharded layer holds all E experts; parallelize_moe keeps this rank's L = E / EP of them (and, under
expert tensor parallelism, swaps each one's linears for column/row-parallel ones). `first` is the global index
of local expert 0, so a checkpoint or a test can name experts the same way on every layout.

Mirrors `megatron-lm:megatron/core/transformer/moe/experts.py::SequentialMLP.forward`.
"""

from __future__ import annotations

import torch

from reference.tensor_parallel.transformer import MLP


class SequentialMLP(torch.nn.Module):
    """`local_experts[i]` is expert `first + i`; forward splits the rows by `tokens_per_expert` and runs each."""

    def __init__(self, experts: list[MLP], first: int = 0):
        super().__init__()
        self.local_experts, self.first = torch.nn.ModuleList(experts), first

    def keep(self, first: int, count: int) -> None:
        """Keep experts first .. first + count - 1 of those held (expert parallelism), drop the rest."""
        self.local_experts = torch.nn.ModuleList(
            list(self.local_experts)[first - self.first : first - self.first + count]
        )
        self.first = first

    def forward(self, rows: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """Mirrors `megatron-lm:megatron/core/transformer/moe/experts.py::SequentialMLP.forward`."""
        blocks = rows.split(tokens_per_expert, dim=0)
        return torch.cat([expert(block) for expert, block in zip(self.local_experts, blocks)], dim=0)

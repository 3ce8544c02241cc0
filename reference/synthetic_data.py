"""The synthetic training data of every demo, trace, benchmark and test: uniformly random token ids.

One generator, seeded apart from the weights (seed + 1), so that the same seed gives the same batches on
every rank and in every single-process oracle; each rank then takes its own rows.
"""

from __future__ import annotations

import torch


def random_token_batches(vocab_size: int, steps: int, batch_size: int, length: int, seed: int) -> list[torch.Tensor]:
    """`steps` batches of token ids [batch_size, length] in [0, vocab_size), the same for a given seed."""
    generator = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(vocab_size, (batch_size, length), generator=generator) for _ in range(steps)]

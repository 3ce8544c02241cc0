"""Combine: each token's output is the sum over its k experts of the router probability times that expert's
output, computed where the token lives, after the rows came back.

Megatron-core at the pin gets the same sum another way: the probabilities travel with the tokens in the
all-to-all and each expert scales its activations by them (`per_token_scale` in MLP.forward), which, fc2 being
linear, is the same product. Here they stay home, and the expert stays a plain MLP.

Mirrors `megatron-lm:megatron/core/transformer/moe/moe_utils.py::unpermute` (given `probs`) and
`megatron-lm:megatron/core/transformer/mlp.py::MLP.forward` (its per_token_scale).
"""

from __future__ import annotations

import torch

from reference.moe.permute import unpermute


def combine(
    rows: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, sorted_indices: torch.Tensor
) -> torch.Tensor:
    """rows [routed pairs, h] in permute's order -> [T, h]: sum_k probs[t, e_k] * rows of token t.

    Mirrors `megatron-lm:megatron/core/transformer/moe/moe_utils.py::unpermute`.
    """
    weights = probs.T.masked_select(routing_map.T)  # the same expert-major order as permute's rows
    weighted = rows * weights.unsqueeze(-1)
    return unpermute(weighted, sorted_indices, probs.shape[0]).to(rows.dtype)

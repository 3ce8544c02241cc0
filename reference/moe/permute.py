"""Permute and unpermute: reorder (token, expert) pairs so each expert's tokens are contiguous, and back.

`permute` walks the routing map expert by expert (column by column): expert 0's tokens in token order, then
expert 1's, ... A token routed to k experts appears k times. `unpermute` adds each row back into its token's
row. Both are an index_select and a scatter-add, so autograd gives each the other as its backward.
`sort_chunks` reorders blocks of rows: what the dispatcher receives is grouped by sending rank, and the
experts want it grouped by expert.

Mirrors `megatron-lm:megatron/core/transformer/moe/moe_utils.py::permute`,
`megatron-lm:megatron/core/transformer/moe/moe_utils.py::unpermute` and
`megatron-lm:megatron/core/transformer/moe/moe_utils.py::sort_chunks_by_idxs` (their unfused paths).
"""

from __future__ import annotations

import torch


def permute(tokens: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [T, h], routing_map [T, E] -> (permuted [routed pairs, h], the token index of each row).

    Mirrors `megatron-lm:megatron/core/transformer/moe/moe_utils.py::permute`.
    """
    num_tokens, num_experts = routing_map.shape
    token_of_row = torch.arange(num_tokens, device=tokens.device).expand(num_experts, -1)
    sorted_indices = token_of_row.masked_select(routing_map.T)  # expert-major, then token order
    return tokens.index_select(0, sorted_indices), sorted_indices


def unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[routed pairs, h] -> [T, h]: each row added into the token it came from.

    Mirrors `megatron-lm:megatron/core/transformer/moe/moe_utils.py::unpermute`.
    """
    out = torch.zeros(num_tokens, permuted.shape[-1], dtype=permuted.dtype, device=permuted.device)
    return out.index_add(0, sorted_indices, permuted)


def sort_chunks(rows: torch.Tensor, chunk_sizes: list[int], order: list[int]) -> torch.Tensor:
    """Split `rows` into chunks of `chunk_sizes` and concatenate them in `order`.

    Mirrors `megatron-lm:megatron/core/transformer/moe/moe_utils.py::sort_chunks_by_idxs`.
    """
    chunks = rows.split(chunk_sizes, dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)

"""The capacity-factor mode: each expert takes at most C = ceil(T k / E * capacity_factor) of a rank's T
tokens; a (token, expert) pair beyond that is dropped, its probability zeroed (the residual carries the token).

Which pairs stay: with megatron's default `moe_token_drop_policy="probs"`, an expert keeps its C most
probable tokens; "position" ranks the 0/1 routing map instead, as megatron does. The kept probabilities are
not renormalized, and a token can lose one expert and keep another. Capacity is counted on each rank's own
tokens (under sequence parallelism, its slice). Dropless (no capacity factor) is megatron's default and this
reference's.

Mirrors `megatron-lm:megatron/core/transformer/moe/moe_utils.py::apply_router_token_dropping` and
`megatron-lm:megatron/core/transformer/moe/moe_utils.py::get_capacity`.
"""

from __future__ import annotations

import math

import torch

DROP_POLICIES = ("probs", "position")


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """ceil(T k / E * capacity_factor): the pairs an expert would get under perfect balance, times the factor.

    Mirrors `megatron-lm:megatron/core/transformer/moe/moe_utils.py::get_capacity`.
    """
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def drop_beyond_capacity(
    probs: torch.Tensor, routing_map: torch.Tensor, topk: int, capacity_factor: float, drop_policy: str = "probs"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) [T, E] with each expert's column cut to its capacity.

    Mirrors `megatron-lm:megatron/core/transformer/moe/moe_utils.py::apply_router_token_dropping`.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"unknown drop policy {drop_policy!r}; choose one of {', '.join(DROP_POLICIES)}")
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, num_experts, topk, capacity_factor)
    if capacity > num_tokens:
        return probs, routing_map  # no expert can overflow
    ranked = probs if drop_policy == "probs" else routing_map.int()
    _, kept = torch.topk(ranked, k=capacity, dim=0, sorted=False)  # per expert (column), C tokens
    within = torch.zeros_like(probs).scatter(0, kept, 1).bool()
    routing_map = routing_map & within
    return probs * routing_map, routing_map

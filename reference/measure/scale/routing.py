"""The stated routing of a MoE scale trace: how many of one rank's routed (token, expert) pairs each expert gets.

Zipf's law over the experts: expert i (0-based) is chosen with probability proportional to (i + 1)^-s
(s: the skew, 0 uniform). A token picks k distinct experts, so an expert takes at most the rank's T tokens: a
larger share is capped at T, the rest shared out again. The T k pairs are rounded by largest remainder (ties:
lower index). Every rank routes these counts, in every layer and micro-batch. Experts lie contiguously over EP
(rank r holds experts r L .. r L + L - 1, as in megatron-core), so EP rank 0 holds the hottest: the worst
placement for a given skew.
"""

from __future__ import annotations

import math


def expert_counts(tokens: int, topk: int, num_experts: int, skew: float) -> list[int]:
    """Pairs each expert gets from one rank's `tokens` tokens routed top-`topk`: Zipf(`skew`), capped, rounded."""
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be between 1 and the number of experts ({num_experts}), got {topk}")
    weights = [(i + 1) ** -skew for i in range(num_experts)]
    pairs, capped = tokens * topk, 0  # the hottest experts are capped first: a prefix
    while True:
        left, rest = pairs - tokens * capped, math.fsum(weights[capped:])
        shares = [tokens] * capped + [left * w / rest for w in weights[capped:]]
        over = sum(1 for share in shares[capped:] if share > tokens)
        if not over:
            break
        capped += over
    counts = [math.floor(share) for share in shares]
    extra = sorted(range(num_experts), key=lambda i: (counts[i] - shares[i], i))[: pairs - sum(counts)]
    for i in extra:
        counts[i] += 1
    return counts


def ep_rank_pairs(counts: list[int], ep: int) -> list[int]:
    """Pairs one rank sends to each EP rank: the counts of the experts that rank holds."""
    local = len(counts) // ep
    return [sum(counts[r * local : (r + 1) * local]) for r in range(ep)]


def imbalance(counts: list[int], ep: int) -> dict:
    """The imbalance of `counts`: per expert max/mean, and the busiest EP rank's received pairs over the mean
    (each EP rank receives ep times what one rank sends it; the mean is T k)."""
    pairs, per_rank = sum(counts), ep_rank_pairs(counts, ep)
    mean_expert = pairs / len(counts)
    return {
        "pairs": pairs,
        "expert_mean": mean_expert,
        "expert_max": max(counts),
        "expert_min": min(counts),
        "expert_max_over_mean": max(counts) / mean_expert,
        "ep_rank_received": [ep * n for n in per_rank],
        "ep_rank_mean": pairs,
        "busiest_ep_rank_over_mean": ep * max(per_rank) / pairs,
        "quietest_ep_rank_over_mean": ep * min(per_rank) / pairs,
    }

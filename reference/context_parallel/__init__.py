"""Context parallelism: the sequence split over the cp ranks, attention made whole again by communication.

`load_balance`: which sequence chunks a rank holds (head-tail, megatron's `get_batch_on_this_cp_rank`) and
which (query chunk, key chunk) blocks each rank computes per ring step; `ring_attention`: K/V passed around the
ring by point-to-point, partial outputs merged by their log-sum-exp; `all_gather`: Llama 3's gathered K/V;
`all_to_all`: DeepSpeed-Ulysses' sequence-to-head exchange. Each form takes q, k, v as [b, heads, s/cp, d]
(torch's SDPA layout, the sequence on dim 2) and returns this rank's causal attention output.
"""

from reference.context_parallel.all_gather import all_gather_attention
from reference.context_parallel.all_to_all import ulysses_attention
from reference.context_parallel.load_balance import block_counts, held_chunks, positions, ring_blocks, shard, unshard
from reference.context_parallel.ring_attention import ring_attention

__all__ = [
    "all_gather_attention",
    "block_counts",
    "held_chunks",
    "positions",
    "ring_attention",
    "ring_blocks",
    "shard",
    "ulysses_attention",
    "unshard",
]

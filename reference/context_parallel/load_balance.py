"""Which tokens a cp rank holds, and which attention blocks it computes: the causal load balance.

Cut the sequence into chunks. Without balancing rank r holds chunk r of cp; under a causal mask the last rank's
queries see every key and the first rank's see only their own, so rank 0 idles while rank cp - 1 works. Head-tail
("zig-zag") balancing cuts 2 cp chunks and gives rank r chunks r and 2 cp - 1 - r: one early, one late, the same
work on every rank. A block (query chunk, key chunk) is "full" when the keys all precede the queries, "masked"
(causal within the block) on the diagonal, "skipped" when every key follows every query.

Mirrors `megatron-lm:megatron/core/utils.py::get_batch_on_this_cp_rank` (the 2 cp chunks, r and 2 cp - 1 - r)
and `pytorch:torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py::_HeadTailLoadBalancer`;
the per-step blocks are those of
`pytorch:torch/distributed/tensor/experimental/_context_parallel/_attention.py::_is_causal_behavior`.
"""

from __future__ import annotations

import torch

from reference.parallel_state import divide

KINDS = ("full", "masked", "skipped")


def held_chunks(rank: int, cp: int, balanced: bool = True) -> tuple[int, ...]:
    """The chunks rank `rank` holds, in order: (r, 2 cp - 1 - r) of 2 cp balanced, (r,) of cp otherwise."""
    return (rank, 2 * cp - 1 - rank) if balanced else (rank,)


def chunk_count(cp: int, balanced: bool = True) -> int:
    return 2 * cp if balanced else cp


def shard(x: torch.Tensor, dim: int, rank: int, cp: int, balanced: bool = True) -> torch.Tensor:
    """This rank's tokens of `x` along `dim`: its held chunks, concatenated. Refuses a length the chunks do not
    divide (one line)."""
    n = chunk_count(cp, balanced)
    by = f"2 x cp ({n} chunks, head-tail balanced)" if balanced else "cp"
    divide(x.shape[dim], n, "the sequence length", by=by)
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[c] for c in held_chunks(rank, cp, balanced)], dim=dim)


def unshard(shards: list[torch.Tensor], dim: int, balanced: bool = True) -> torch.Tensor:
    """The whole sequence from every rank's shard (rank order): shard's inverse."""
    cp = len(shards)
    pieces = {}
    for rank, local in enumerate(shards):
        held = held_chunks(rank, cp, balanced)
        pieces.update(zip(held, local.chunk(len(held), dim=dim)))
    return torch.cat([pieces[c] for c in range(chunk_count(cp, balanced))], dim=dim)


def positions(seq_length: int, rank: int, cp: int, balanced: bool = True, device=None) -> torch.Tensor:
    """The position ids of the tokens this rank holds: what its rotary and position embeddings read."""
    return shard(torch.arange(seq_length, device=device), 0, rank, cp, balanced)


def block_kind(query_chunk: int, key_chunk: int) -> str:
    """How a block of the causal attention matrix is computed: all keys before the queries, the diagonal, or
    none needed."""
    if key_chunk < query_chunk:
        return "full"
    return "masked" if key_chunk == query_chunk else "skipped"


def ring_blocks(cp: int, balanced: bool = True) -> list[list[list[tuple[int, int, str]]]]:
    """[rank][step] -> the (query chunk, key chunk, kind) blocks of that ring step: at step i rank r holds the
    K/V of rank (r - i) mod cp (each step passes them one rank on)."""
    return [
        [
            [(q, k, block_kind(q, k)) for q in held_chunks(rank, cp, balanced) for k in held_chunks(src, cp, balanced)]
            for src in ((rank - step) % cp for step in range(cp))
        ]
        for rank in range(cp)
    ]


def block_counts(cp: int, balanced: bool = True) -> list[dict[str, int]]:
    """Per rank, how many blocks of each kind it meets over the ring (blocks of s / (2 cp) balanced, s / cp
    otherwise): balanced, every rank the same; not, rank 0 all skipped but its diagonal."""
    per_rank = [[kind for step in steps for _, _, kind in step] for steps in ring_blocks(cp, balanced)]
    return [{kind: kinds.count(kind) for kind in KINDS} for kinds in per_rank]

"""Context parallelism applied to a GPT stage: its tokens are the head-tail shard of the sequence, its
attention the ring over the cp group.

Three settings, nothing swapped: the stage's `positions` (the position ids of its held chunks, which the
learned position embedding and the rotary tables read), every attention's `cp_group` (causal attention becomes
reference.context_parallel.ring_attention), and, in the train step, each micro-batch's tokens and labels cut
by the same shard (`shard_micro_batch`). The loss is each rank's mean over its s/cp tokens, and gradients
average over dp x cp (the layout's `group("dp_cp")`): the mean of equal-sized shards' means is the sequence's
mean, as megatron reduces loss and gradients over its data-parallel-with-context-parallel group.

Mirrors `megatron-lm:megatron/core/utils.py::get_batch_on_this_cp_rank` (the batch split) and torchtitan's
`context_parallel` around its train step (positions and buffers sharded on the sequence dimension).
"""

from __future__ import annotations

import torch

from reference.context_parallel.load_balance import positions, shard
from reference.parallel_state import ParallelConfigError, ParallelLayout


def parallelize_context(stage, layout: ParallelLayout) -> None:
    """Make `stage` (a reference.gpt.model.GPT) hold this cp rank's shard of the sequence (cp 1: unchanged)."""
    cp = layout.size("cp")
    if cp == 1:
        return
    if stage.config.attention_dropout:
        raise ParallelConfigError(
            "--cp > 1 has no attention dropout here (the ring computes no masks); use --dropout 0"
        )
    stage.positions = positions(stage.config.seq_length, layout.rank_in("cp"), cp)
    for block in stage.layers:
        block.attention.cp_group = layout.group("cp")


def shard_micro_batch(
    inputs: torch.Tensor, labels: torch.Tensor, layout: ParallelLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """This cp rank's tokens and labels [b, s/cp] of a micro-batch [b, s] (cp 1: as they are)."""
    if layout.size("cp") == 1:
        return inputs, labels
    rank, cp = layout.rank_in("cp"), layout.size("cp")
    return shard(inputs, 1, rank, cp), shard(labels, 1, rank, cp)

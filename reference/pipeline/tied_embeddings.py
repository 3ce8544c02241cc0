"""Tied input and output embeddings across pipeline stages (Megatron's `share_embeddings_and_output_weights`).

The first stage embeds tokens and the last produces logits with one matrix, each end holding a copy. At
construction the last stage zeroes its copy and the embedding group (the first- and last-stage ranks of one DP
and TP coordinate, the layout's "embedding" group) all-reduces it; every step, after the DP reduction, the group
sums the two copies' gradients, so both take the same step.

Mirrors
`megatron-lm:megatron/core/models/common/language_module/language_module.py::LanguageModule.setup_embeddings_and_output_layer`
and `megatron-lm:megatron/core/distributed/finalize_model_grads.py::_allreduce_word_embedding_grads`, over the
embedding group of `megatron-lm:megatron/core/parallel_state.py::initialize_model_parallel`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from reference.parallel_state import ParallelLayout

if TYPE_CHECKING:  # reference.gpt imports the pipeline; a type is all this file needs from it
    from reference.gpt.model import GPT


def embedding_group(layout: ParallelLayout) -> dist.ProcessGroup | None:
    """This rank's embedding group: itself and the rank at the other end of its pipeline (same DP and TP
    coordinates), made with the layout's other groups; None on a middle stage or without pipelining."""
    return layout.group("embedding")


def shared_weight(stage: GPT) -> torch.nn.Parameter | None:
    """The copy of the tied matrix this stage holds: the word embedding (first stage) or the output layer's
    weight (last stage); None on a middle stage."""
    if stage.is_first:
        return stage.embedding.word_embeddings.weight
    if stage.is_last:
        return stage.output_layer.weight
    return None


@torch.no_grad()
def tie_across_stages(stage: GPT, group: dist.ProcessGroup | None) -> None:
    """Make the last stage's output weight a copy of the first stage's word embedding (zero it, all-reduce).

    Mirrors
    `megatron-lm:megatron/core/models/common/language_module/language_module.py::LanguageModule.setup_embeddings_and_output_layer`.
    """
    weight = shared_weight(stage)
    if group is None or weight is None:
        return
    if not stage.is_first:
        weight.zero_()
    dist.all_reduce(weight, group=group)


def allreduce_word_embedding_grads(stage: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum the two ends' gradients of the tied matrix (`main_grad` when the DP wrapper keeps one).

    Mirrors `megatron-lm:megatron/core/distributed/finalize_model_grads.py::_allreduce_word_embedding_grads`.
    """
    weight = shared_weight(stage)
    if group is None or weight is None:
        return
    grad = weight.main_grad if hasattr(weight, "main_grad") else weight.grad
    dist.all_reduce(grad, group=group)

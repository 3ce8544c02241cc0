"""After the last micro-batch's backward: every gradient reduction the optimizer step waits for, in one call.

First each model chunk's `finish_grad_sync()` (the DP all-reduce, or nothing left to wait for under FSDP; an
FSDP2 module has none to call), then the TP sum of the sequence-parallel LayerNorm and bias gradients, then,
with tied embeddings, the sum of the shared matrix's two ends over the embedding group. The sums commute; the
order is Megatron's.

Mirrors `megatron-lm:megatron/core/distributed/finalize_model_grads.py::finalize_model_grads`, which the
pipeline schedules call once per step. The site's page on this module (notes/reference/data_parallel.finalize.md)
says why each reduction is there and how FSDP x TP uses the same call.
"""

from __future__ import annotations

import torch.distributed as dist

from reference.data_parallel.wrapper import DistributedDataParallel
from reference.fsdp import FullyShardedDataParallel
from reference.fsdp2 import FSDPModule
from reference.pipeline.tied_embeddings import allreduce_word_embedding_grads
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads


def finalize_model_grads(
    model_chunks: list[DistributedDataParallel | FullyShardedDataParallel | FSDPModule],
    tp_group: dist.ProcessGroup | None = None,
    embedding_group: dist.ProcessGroup | None = None,
) -> None:
    """DP-average every chunk's gradients (each chunk's `finish_grad_sync()`: DDP waits for its bucket
    all-reduces, FSDP's were reduce-scattered by the end of backward), then TP-sum the sequence-parallel ones
    (when a TP group is given), then sum the tied embedding's over the embedding group (when one is given).

    Mirrors `megatron-lm:megatron/core/distributed/finalize_model_grads.py::finalize_model_grads`.
    """
    for chunk in model_chunks:
        if not isinstance(chunk, FSDPModule):  # FSDP2: the root's end-of-backward callback waited already
            chunk.finish_grad_sync()
    if tp_group is not None:
        for chunk in model_chunks:
            allreduce_sequence_parallel_grads(chunk, tp_group)
    if embedding_group is not None:
        for chunk in model_chunks:
            allreduce_word_embedding_grads(chunk.module, embedding_group)

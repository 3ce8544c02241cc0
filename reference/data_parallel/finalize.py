"""After the last micro-batch's backward: every gradient reduction the optimizer step waits for, in one call.

Counterpart: megatron/core/distributed/finalize_model_grads.py::finalize_model_grads, which the pipeline
schedules call once per step (`config.finalize_model_grads_func`): first each model chunk's
`finish_grad_sync()` (the DP all-reduce), then `_allreduce_non_tensor_model_parallel_grads` (the TP sum of
sequence-parallel LayerNorm / row-bias gradients, reference.tensor_parallel.layers.
allreduce_sequence_parallel_grads). The two reductions commute (both are sums over orthogonal groups), so the
order is Megatron's, not a requirement. Then, with tied embeddings across pipeline stages, the sum of the two
ends' gradients of the shared matrix over the embedding group (reference.pipeline.tied_embeddings, Megatron's
`_allreduce_word_embedding_grads`), after the DP average: both sums commute, as Megatron orders them.

The same call finalizes a reference FSDP chunk (reference.data_parallel.fsdp_tp): its `finish_grad_sync()` has
nothing to wait for (its own end-of-backward callback waited for the reduce-scatters), so only the TP sum
remains, and FSDP x TP runs it on the sharded gradients (fsdp_tp says why that is right). Megatron's
finalize_model_grads likewise serves DDP and its FSDP wrappers, which both expose `finish_grad_sync`.
"""

from __future__ import annotations

import torch.distributed as dist

from reference.data_parallel.wrapper import DistributedDataParallel
from reference.fsdp import FullyShardedDataParallel
from reference.pipeline.tied_embeddings import allreduce_word_embedding_grads
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads


def finalize_model_grads(
    model_chunks: list[DistributedDataParallel | FullyShardedDataParallel],
    tp_group: dist.ProcessGroup | None = None,
    embedding_group: dist.ProcessGroup | None = None,
) -> None:
    """DP-average every chunk's gradients (each chunk's `finish_grad_sync()`: DDP waits for its bucket
    all-reduces, FSDP's were reduce-scattered by the end of backward), then TP-sum the sequence-parallel ones
    (when a TP group is given), then sum the tied embedding's over the embedding group (when one is given).

    Mirrors `megatron-lm:megatron/core/distributed/finalize_model_grads.py::finalize_model_grads`.
    """
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    if tp_group is not None:
        for chunk in model_chunks:
            allreduce_sequence_parallel_grads(chunk, tp_group)
    if embedding_group is not None:
        for chunk in model_chunks:
            allreduce_word_embedding_grads(chunk.module, embedding_group)

"""After the last micro-batch's backward: every gradient reduction the optimizer step waits for, in one call.

Counterpart: megatron/core/distributed/finalize_model_grads.py::finalize_model_grads, which the pipeline
schedules call once per step (`config.finalize_model_grads_func`): first each model chunk's
`finish_grad_sync()` (the DP all-reduce), then `_allreduce_non_tensor_model_parallel_grads` (the TP sum of
sequence-parallel LayerNorm / row-bias gradients, reference.tensor_parallel.layers.
allreduce_sequence_parallel_grads). The two reductions commute (both are sums over orthogonal groups), so the
order is Megatron's, not a requirement. Tied-embedding and pipeline-stage reductions belong to the pipeline.
"""
from __future__ import annotations

import torch.distributed as dist

from reference.data_parallel.wrapper import DistributedDataParallel
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads


def finalize_model_grads(model_chunks: list[DistributedDataParallel], tp_group: dist.ProcessGroup | None = None
                         ) -> None:
    """DP-average every chunk's gradients, then TP-sum the sequence-parallel ones (when a TP group is given)."""
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    if tp_group is not None:
        for chunk in model_chunks:
            allreduce_sequence_parallel_grads(chunk, tp_group)

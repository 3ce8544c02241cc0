"""Data parallelism over the DP group of a TP x PP x DP layout, one mechanism per file:

buckets.py   gradients packed into flat buckets (reverse parameter order, ~bucket_size bytes each)
wrapper.py   DistributedDataParallel: bucket all-reduces overlapped with backward, no_sync, finish_grad_sync
gradient_shards.py  ZeRO-2: the distributed optimizer, each rank keeping only its shard of the reduced gradients
finalize.py  finalize_model_grads: DP all-reduce, then the TP sum of sequence-parallel gradients
fsdp_tp.py   2D parallelism: reference FSDP over the DP group of TP-sharded transformer blocks
fsdp2_tp.py  2D parallelism: the reference FSDP2, per parameter, over the DP group of a TP-sharded model
"""

from reference.data_parallel.finalize import finalize_model_grads
from reference.data_parallel.wrapper import DistributedDataParallel, local_batch

__all__ = ["DistributedDataParallel", "finalize_model_grads", "local_batch"]

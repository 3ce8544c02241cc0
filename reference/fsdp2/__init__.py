"""Reference FSDP2: `fully_shard`, parameter by parameter, as PyTorch's `torch.distributed.fsdp.fully_shard`.

The sibling of reference/fsdp (FSDP1's flat parameters). Files, one mechanism each: `mesh.py` (the shard and
replicate groups), `param.py` (one parameter's dim-0 shard and unsharded buffer), `collectives.py` (one
all-gather and one reduce-scatter per group, through flat buffers), `param_group.py` (a group's unshard,
reshard, reduce and implicit backward prefetch), `state.py` (the module hooks and the root), `fully_shard.py`
(the API). Recording by group is an observer: reference.measure.fsdp_tracing.
"""

from reference.fsdp2.fully_shard import FSDPModule, MixedPrecisionPolicy, fully_shard
from reference.fsdp2.mesh import ShardMesh

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "ShardMesh", "fully_shard"]

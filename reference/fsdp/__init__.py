"""Reference FSDP: flat parameters sharded per unit, prefetched all-gathers, reduce-scattered gradients.

Files, one mechanism each: `flat_param.py` (flatten, shard, views), `prefetch.py` (execution order and
which unit to all-gather early), `runtime.py` (forward/backward hooks), `wrapper.py` (the FSDP1-style
module wrapper), `units.py` (one unit per layer, then the root, with the reference or torch's FSDP1/FSDP2), `demo.py`
(`torchrun -m reference --fsdp`). Recording by unit is an observer: reference.measure.fsdp_tracing.
"""

from reference.fsdp.prefetch import BackwardPrefetch
from reference.fsdp.wrapper import CPUOffload, FullyShardedDataParallel, MixedPrecision

__all__ = ["BackwardPrefetch", "CPUOffload", "FullyShardedDataParallel", "MixedPrecision"]

"""`parallelize_moe(layer, layout)`: expert parallelism applied to the plain MoE layer, in place.

Each EP rank keeps L = E / EP of the experts (rank r: experts r L .. r L + L - 1) and the dispatcher gets
the groups it exchanges tokens over. With a TP group of p > 1 ranks, each kept expert is also split over TP,
as megatron-core does by default (its expert-TP size defaults to the TP size): fc1 column-parallel, fc2
row-parallel, neither reducing (`explicit_expert_comm`), since the dispatcher gathers the expert input over TP
and reduce-scatters the output. The layer then expects sequence-parallel input (this rank's slice of the
sequence), as megatron requires with EP and TP; the router's gradient is partial per TP rank
(marked `sequence_parallel`: allreduce_sequence_parallel_grads sums it).

Mirrors `megatron-lm:megatron/core/transformer/moe/moe_layer.py::BaseMoELayer.__init__`.
"""

from __future__ import annotations

import torch.distributed as dist

from reference.moe.dispatcher import AllToAllDispatcher
from reference.moe.layer import MoELayer
from reference.parallel_state import ParallelConfigError, ParallelLayout
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.parallelize import _swap


def parallelize_moe(
    layer: MoELayer,
    layout: ParallelLayout | dist.ProcessGroup | None,
    tp_group: dist.ProcessGroup | None = None,
) -> MoELayer:
    """Split `layer`'s experts over the layout's EP group (and each over its TP group), in place; every rank calls
    it. Or give the groups: an EP group (None: EP 1) and a TP group.

    Mirrors `megatron-lm:megatron/core/transformer/moe/moe_layer.py::BaseMoELayer.__init__` (its local experts).
    """
    ep_group = layout.ep_group if isinstance(layout, ParallelLayout) else layout
    tp_group = layout.tp_group if isinstance(layout, ParallelLayout) else tp_group
    done = layer.dispatcher.ep_group or layer.dispatcher.tp_group
    if done is not None or len(layer.experts.local_experts) != layer.num_experts:
        raise ParallelConfigError("this MoE layer is already split over an expert-parallel group; parallelize it once")
    dispatcher = AllToAllDispatcher(layer.num_experts, ep_group, tp_group)
    local = dispatcher.num_local_experts
    layer.experts.keep((0 if ep_group is None else ep_group.rank()) * local, local)
    if tp_group is not None and tp_group.size() > 1:
        for expert in layer.experts.local_experts:
            stride = 2 if expert.gated else 1  # SwiGLU's [gate; up]: each rank its slice of both
            expert.fc1 = _swap(expert.fc1, ColumnParallelLinear, tp_group, stride, explicit_expert_comm=True)
            expert.fc2 = _swap(expert.fc2, RowParallelLinear, tp_group, explicit_expert_comm=True)
        layer.router.count_group = tp_group  # the load-balancing loss counts the whole sequence's tokens
        layer.router.weight.sequence_parallel = True
    layer.dispatcher = dispatcher
    return layer

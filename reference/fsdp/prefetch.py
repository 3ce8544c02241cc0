"""Prefetch policy: which unit's all-gather to issue early, from the execution order FSDP recorded.

Forward prefetches unit l+1 from unit l's pre-forward, from the second iteration on (the order is recorded on
the first); backward prefetches the unit that ran forward just before, from the post-forward order of every
iteration, before or after unit l's gradient computation. A unit already unsharded or prefetched is skipped.

Mirrors `pytorch:torch/distributed/fsdp/_exec_order_utils.py::_ExecOrderData` and
`pytorch:torch/distributed/fsdp/_runtime_utils.py::_get_handle_to_prefetch`, with upstream's default prefetch
limit of 1 (notes/reference/fsdp.prefetch.md maps each method).
"""

from __future__ import annotations

from enum import Enum, auto

from reference.fsdp.flat_param import FlatParamHandle, HandleTrainingState


class BackwardPrefetch(Enum):
    """Same members and meaning as `pytorch:torch/distributed/fsdp/api.py::BackwardPrefetch`."""

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


class PrefetchMode(Enum):
    """`_runtime_utils.py::_PrefetchMode`: which training state a prefetched handle pretends to be in.

    Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_PrefetchMode`.
    """

    BACKWARD = auto()
    FORWARD = auto()


class ExecutionOrder:
    """The unit order FSDP observed, shared by every unit under one root.

    Mirrors `pytorch:torch/distributed/fsdp/_exec_order_utils.py::_ExecOrderData`.
    """

    def __init__(self) -> None:
        self.iteration = 0
        self.pre_forward_order: list[FlatParamHandle] = []
        self.post_forward_order: list[FlatParamHandle] = []

    def record_pre_forward(self, handle: FlatParamHandle) -> None:
        if self.iteration > 0 or handle.pre_forward_order_index is not None:
            return
        handle.pre_forward_order_index = len(self.pre_forward_order)
        self.pre_forward_order.append(handle)

    def record_post_forward(self, handle: FlatParamHandle) -> None:
        if handle.post_forward_index is None:
            handle.post_forward_index = len(self.post_forward_order)
        self.post_forward_order.append(handle)

    def next_iter(self) -> None:
        """Called from the post-backward final callback: the true end of an iteration."""
        self.iteration += 1
        self.post_forward_order.clear()

    def next_in_forward(self, handle: FlatParamHandle) -> FlatParamHandle | None:
        index = handle.pre_forward_order_index
        if index is None or index + 1 >= len(self.pre_forward_order):
            return None
        return self.pre_forward_order[index + 1]

    def next_in_backward(self, handle: FlatParamHandle) -> FlatParamHandle | None:
        index = handle.post_forward_index
        if index is None or index == 0:
            return None
        return self.post_forward_order[index - 1]


def handle_to_prefetch(
    order: ExecutionOrder, current: FlatParamHandle, forward_prefetch: bool, backward_prefetch: BackwardPrefetch | None
) -> FlatParamHandle | None:
    """`_get_handle_to_prefetch`: the unit to all-gather early given the current unit's training state.

    Mirrors `pytorch:torch/distributed/fsdp/_runtime_utils.py::_get_handle_to_prefetch`.
    """
    state = current.training_state
    if (state == HandleTrainingState.BACKWARD_PRE and backward_prefetch == BackwardPrefetch.BACKWARD_PRE) or (
        state == HandleTrainingState.BACKWARD_POST and backward_prefetch == BackwardPrefetch.BACKWARD_POST
    ):
        candidate = order.next_in_backward(current)
        if candidate is not None and candidate.needs_pre_backward_unshard and not candidate.prefetched:
            return candidate
    elif state == HandleTrainingState.FORWARD and forward_prefetch:
        candidate = order.next_in_forward(current)
        if candidate is not None and candidate.needs_pre_forward_unshard and not candidate.prefetched:
            return candidate
    return None

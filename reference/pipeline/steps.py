"""One stage's forward and backward steps, and the data-parallel sync switch around them.

Shared by every schedule (reference.pipeline.schedules, reference.pipeline.interleaved): a schedule decides the
order; these run each action and name it. An optional observer (reference.measure.pipeline_meter) wraps each
action in `observer.action(name)`; the steps themselves measure nothing.

Counterparts: Megatron's forward_step and backward_step (cited on the methods below), and the
disable_grad_sync / enable_grad_sync closures of its schedule functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from reference.tensor_parallel.deferred_wgrad import WeightGradStore


class GradSync:
    """Megatron's disable_grad_sync / enable_grad_sync around the user's no_sync context."""

    def __init__(self, no_sync: Callable[[], contextlib.AbstractContextManager]):
        self.no_sync, self.context = no_sync, None

    def disable(self) -> None:
        if self.context is None:
            self.context = self.no_sync()
            self.context.__enter__()

    def enable(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None


class Steps:
    """forward_step / backward_step of one stage's model chunks (one, or v under interleaving), the backward
    also in two (I, then W) for zero-bubble schedules. Actions are named F<i>/B<i>/I<i>/W<i>, or F<c>.<i>, ...
    for chunk c of several (as megatron-core's vp_stage numbers them)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], micro_batches: Sequence[tuple], is_last: bool, observer=None):
        self.chunks, self.micro_batches, self.is_last_rank, self.observer = chunks, micro_batches, is_last, observer
        self.losses: list[torch.Tensor] = []  # detached, read once at the end (schedules.loss_values)
        self.weight_grads = WeightGradStore()  # what each I left for its W (zero-bubble schedules)

    def _action(self, kind: str, i: int, chunk: int) -> contextlib.AbstractContextManager:
        name = f"{kind}{i}" if len(self.chunks) == 1 else f"{kind}{chunk}.{i}"
        return contextlib.nullcontext() if self.observer is None else self.observer.action(name)

    def forward(self, i: int, input_tensor: torch.Tensor | None, chunk: int = 0) -> torch.Tensor:
        """Mirrors `megatron-lm:megatron/core/pipeline_parallel/schedules.py::forward_step`."""
        with self._action("F", i, chunk):
            output = self.chunks[chunk](*self.micro_batches[i], hidden=input_tensor)
            if self.is_last_rank and chunk == len(self.chunks) - 1:  # the loss: keep it, scale it for the mean
                self.losses.append(output.detach())
                output = output / len(self.micro_batches)
        return output

    def backward(self, i: int, input_tensor, output, output_grad, chunk: int = 0) -> torch.Tensor | None:
        """Mirrors `megatron-lm:megatron/core/pipeline_parallel/schedules.py::backward_step`."""
        with self._action("B", i, chunk):
            torch.autograd.backward(output, grad_tensors=output_grad)  # output_grad None: output is the loss
        return None if input_tensor is None else input_tensor.grad

    def backward_input(self, i: int, input_tensor, output, output_grad, chunk: int = 0) -> torch.Tensor | None:
        """I: the backward with the linears' weight gradients left in `weight_grads` for backward_weight; the
        input gradient (what the stage before waits for) and every other parameter's gradient are computed.

        Mirrors megatron's delay_wgrad_compute, see reference.tensor_parallel.deferred_wgrad.
        """
        with self._action("I", i, chunk), self.weight_grads.collect((chunk, i)):
            torch.autograd.backward(output, grad_tensors=output_grad)
        if self.observer is not None:  # the memory the deferral holds is shown, not hidden
            self.observer.weight_grads_held(self.weight_grads.held_bytes)
        return None if input_tensor is None else input_tensor.grad

    def backward_weight(self, i: int, chunk: int = 0) -> None:
        """W: the weight gradients backward_input left for micro-batch i, computed and accumulated; their
        inputs are let go.

        Mirrors `megatron-lm:megatron/core/extensions/transformer_engine.py::TELinear.backward_dw`.
        """
        with self._action("W", i, chunk):
            self.weight_grads.run((chunk, i))

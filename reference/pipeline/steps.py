"""One stage's forward and backward steps, timed and measured, and the data-parallel sync switch around them.

Shared by every schedule (reference.pipeline.schedules, reference.pipeline.interleaved): a schedule decides the
order; these run each action, name it, time it and count what it keeps alive.

Counterparts: megatron/core/pipeline_parallel/schedules.py::forward_step and ::backward_step, and the
disable_grad_sync / enable_grad_sync closures of its schedule functions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch

from reference.pipeline.in_flight import InFlightActivations
from reference.recorder import CollectiveRecorder


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
    """forward_step / backward_step of one stage's model chunks (one, or v under interleaving), timed, counted
    and measured. Actions are named F<i>/B<i>, or F<c>.<i>/B<c>.<i> for chunk c of several (as megatron-core's
    vp_stage numbers them)."""

    def __init__(
        self, chunks: Sequence[torch.nn.Module], micro_batches: Sequence[tuple], is_last: bool, device: torch.device
    ):
        self.chunks, self.micro_batches, self.is_last_rank = chunks, micro_batches, is_last
        self.cuda = device if device.type == "cuda" else None
        self.meter = InFlightActivations()
        self.actions: list[str] = []
        self.spans: list[tuple[float, float]] = []
        self.flops: list[int] = []
        self.losses: list[torch.Tensor] = []  # detached, read once at the end (loss_values)
        self.in_flight = self.peak_in_flight = 0

    def _name(self, kind: str, i: int, chunk: int) -> str:
        return f"{kind}{i}" if len(self.chunks) == 1 else f"{kind}{chunk}.{i}"

    def _timed(self, name: str, fn, *args):
        recorder = (CollectiveRecorder.active() or [None])[-1]
        start, flops = time.perf_counter(), recorder.flops if recorder else 0
        out = fn(*args)
        if self.cuda is not None:  # the action is done when its kernels are, not when they are queued
            torch.cuda.synchronize(self.cuda)
        self.actions.append(name)
        self.spans.append((start, time.perf_counter()))
        self.flops.append(recorder.flops - flops if recorder else 0)
        return out

    def forward(self, i: int, input_tensor: torch.Tensor | None, chunk: int = 0) -> torch.Tensor:
        """Mirrors `megatron-lm:megatron/core/pipeline_parallel/schedules.py::forward_step`."""
        is_last = self.is_last_rank and chunk == len(self.chunks) - 1

        def run():
            with self.meter.forward((chunk, i)):
                output = self.chunks[chunk](input_tensor, *self.micro_batches[i])
            if is_last:  # the loss: keep it, scale it for the mean over micro-batches
                self.losses.append(output.detach())
                output = output / len(self.micro_batches)
            return output

        output = self._timed(self._name("F", i, chunk), run)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return output

    def backward(self, i: int, input_tensor, output, output_grad, chunk: int = 0) -> torch.Tensor | None:
        """Mirrors `megatron-lm:megatron/core/pipeline_parallel/schedules.py::backward_step`."""

        def run():
            torch.autograd.backward(output, grad_tensors=output_grad)  # output_grad None: output is the loss
            return None if input_tensor is None else input_tensor.grad

        input_grad = self._timed(self._name("B", i, chunk), run)
        self.in_flight -= 1
        return input_grad

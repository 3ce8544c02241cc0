"""Measure how many micro-batches' activations a stage really keeps alive, from what autograd saves.

Every tensor autograd saves for backward during micro-batch i's forward is wrapped (torch.autograd.graph.
saved_tensors_hooks) in a small holder tagged with i. Autograd drops the holder when it frees the graph
(after that micro-batch's backward), so counting live holders per micro-batch gives the micro-batches in
flight and the bytes they hold, as the schedule runs, independently of the schedule's own bookkeeping.
Parameters saved by a layer are not activations and are not counted in the bytes.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch


class _Saved:
    """A saved tensor, and the accounting to undo when autograd lets go of it."""

    __slots__ = ("tensor", "owner", "micro_batch", "nbytes")

    def __init__(self, tensor, owner, micro_batch, nbytes):
        self.tensor, self.owner, self.micro_batch, self.nbytes = tensor, owner, micro_batch, nbytes

    def __del__(self):
        self.owner._release(self.micro_batch, self.nbytes)


class InFlightActivations:
    """`with meter.forward(i): output = stage(...)`; read `peak_micro_batches` and `peak_bytes` afterwards.

    Mirrors `megatron-lm:megatron/core/pipeline_parallel/schedules.py::deallocate_output_tensor`.
    """

    def __init__(self) -> None:
        self.live: Counter[int] = Counter()  # micro-batch -> saved tensors still alive
        self.bytes = 0
        self.peak_micro_batches = 0
        self.peak_bytes = 0

    @contextlib.contextmanager
    def forward(self, micro_batch: int) -> Iterator[None]:
        def pack(tensor: torch.Tensor) -> _Saved:
            nbytes = 0 if isinstance(tensor, torch.nn.Parameter) else tensor.numel() * tensor.element_size()
            self.live[micro_batch] += 1
            self.bytes += nbytes
            self.peak_micro_batches = max(self.peak_micro_batches, len(self.live))
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            return _Saved(tensor, self, micro_batch, nbytes)

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.tensor):
            yield

    def _release(self, micro_batch: int, nbytes: int) -> None:
        self.bytes -= nbytes
        self.live[micro_batch] -= 1
        if not self.live[micro_batch]:
            del self.live[micro_batch]

"""The observer a pipeline schedule takes: what each stage did, when, and how long it idled.

`meter = PipelineMeter(device)`, then `forward_backward(..., observer=meter)` (or `train_step(...,
observer=meter)`), then read the meter. Per action (F<i>/B<i>, as reference.pipeline.steps names them): its
start and end (perf_counter(), the recorder's clock; on CUDA after a synchronize, since an action is done when
its kernels are), its FLOPs as the innermost active CollectiveRecorder counts them, and the micro-batches in
flight, as the order implies and as autograd keeps them (in_flight.py). Around the schedule, a barrier of the
PP group at each end gives every stage one common interval, whose idle fraction is its wall-clock bubble
(Megatron has no such barriers); replay.py gives the schedule's own bubble, in modeled time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from reference.measure.in_flight import InFlightActivations
from reference.measure.recorder import CollectiveRecorder
from reference.pipeline.schedules import bubble_formula

_NOT_IN_DICT = ("device", "schedule_name", "_in_flight", "_autograd")


@dataclasses.dataclass
class PipelineMeter:
    """One stage's record of its last schedule; `schedule` and `action` are the observer's two hooks."""

    device: torch.device | None = None  # CUDA: synchronize at the end of each action
    schedule_name: str = ""
    virtual_stages: int = 1  # model chunks on this stage (v); > 1: interleaved 1F1B
    pp_rank: int = 0
    pp_size: int = 1
    num_micro_batches: int = 0
    actions: list[str] = dataclasses.field(default_factory=list)  # "F0", "B0", ... in the order run
    action_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (start, end), perf_counter()
    action_flops: list[int] = dataclasses.field(default_factory=list)  # as a CollectiveRecorder counted (0 without)
    start_s: float = 0.0  # perf_counter() when the schedule started (after the PP barrier)
    total_s: float = 0.0  # from start_s to the end of the schedule (its closing PP barrier)
    peak_in_flight: int = 0  # forwards whose backward had not run, as the order implies
    peak_in_flight_measured: int = 0  # micro-batches whose saved activations autograd still held
    peak_activation_bytes: int = 0  # bytes of those saved activations at their peak
    peak_weight_grad_bytes: int = 0  # zero bubble: what the I's left for their W's held, at most
    _in_flight: int = 0
    _autograd: InFlightActivations = dataclasses.field(default_factory=InFlightActivations)

    @contextlib.contextmanager
    def schedule(self, name: str, pp_group: dist.ProcessGroup, chunks: int, micro_batches: int) -> Iterator[None]:
        """Around one forward_backward: forget the last one, and frame this one with PP barriers."""
        self.__init__(self.device)  # forget the last schedule: every field back to its default
        self.schedule_name, self.virtual_stages, self.num_micro_batches = name, chunks, micro_batches
        self.pp_rank, self.pp_size = pp_group.rank(), pp_group.size()
        if self.pp_size > 1:
            dist.barrier(group=pp_group)
        self.start_s = time.perf_counter()
        yield
        if self.pp_size > 1:
            dist.barrier(group=pp_group)
        self.total_s = time.perf_counter() - self.start_s
        self.peak_in_flight_measured = self._autograd.peak_micro_batches
        self.peak_activation_bytes = self._autograd.peak_bytes

    @contextlib.contextmanager
    def action(self, name: str) -> Iterator[None]:
        """Around one forward or backward step."""
        recorder = (CollectiveRecorder.active() or [None])[-1]
        start, flops = time.perf_counter(), recorder.flops if recorder else 0
        forward = name.startswith("F")
        with self._autograd.forward(name[1:]) if forward else contextlib.nullcontext():
            yield
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.actions.append(name)
        self.action_spans.append((start, time.perf_counter()))
        self.action_flops.append(recorder.flops - flops if recorder else 0)
        self._in_flight += {"F": 1, "B": -1, "I": -1}.get(name[0], 0)  # W: the graph went with its I
        self.peak_in_flight = max(self.peak_in_flight, self._in_flight)

    def weight_grads_held(self, nbytes: int) -> None:
        """After each I (reference.pipeline.steps.Steps.backward_input): the bytes waiting for their W's."""
        self.peak_weight_grad_bytes = max(self.peak_weight_grad_bytes, nbytes)

    @property
    def busy_s(self) -> float:
        """Time in this stage's forward and backward steps: the sum of the action spans."""
        return sum(end - start for start, end in self.action_spans)

    @property
    def wall_clock_bubble(self) -> float:
        """On shared CPU cores, waits for a core and for messages count too: replay.py models the schedule's own."""
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def bubble_formula(self) -> float:
        return bubble_formula(self.pp_size, self.num_micro_batches, self.virtual_stages, self.schedule_name)

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule_name,
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_IN_DICT},
            "busy_s": self.busy_s,
            "wall_clock_bubble": self.wall_clock_bubble,
            "bubble_formula": self.bubble_formula,
        }

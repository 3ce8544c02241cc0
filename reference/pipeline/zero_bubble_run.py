"""Run one rank's zero-bubble action list (reference.pipeline.zero_bubble) with the stage's Steps.

F receives its input (from the rank of the stage before, or, at the turn of the V, from this rank's other
stage), runs and sends its output on; I and B receive the output gradient the same way, run the backward
(I leaves the linears' weight gradients for W) and send the input gradient back; W runs what its I left. An
Overlap runs its forward, then its backward: on one stream they follow each other, and what DualPipeV
gains by overlapping them (one micro-batch's communication behind the other's compute) needs two streams, as
megatron-core's `megatron-lm:megatron/core/pipeline_parallel/combined_1f1b.py::combined_forward_backward_step`
has: it merges a forward and a backward step layer by layer so that one's MoE all-to-all runs under the
other's compute (overlap_moe_expert_parallel_comm).
Between two stages of this rank nothing is sent: the output is handed over detached, a new leaf of the graph
of the stage that takes it, as torch's runtime does.

Gradient reduction over DP: a chunk's backward actions of the last micro-batch (its I or B, and its W) run
with the DP wrapper's sync on, the rest under no_sync, as interleaved 1F1B's last backward of each chunk.

Mirrors `pytorch:torch/distributed/pipelining/schedules.py::_PipelineScheduleRuntime._step_microbatches`
(its compute actions; the transfers as reference.pipeline.p2p.StageP2P posts them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from reference.pipeline.p2p import StageP2P
from reference.pipeline.steps import GradSync, Steps
from reference.pipeline.zero_bubble import Action, Overlap, flat, rank_order, stages_of


def rank_of_stage(stage: int, p: int) -> int:
    """The rank holding a stage: stage s < p on rank s, and in a V stage p + k on rank p - 1 - k."""
    return stage if stage < p else 2 * p - 1 - stage


class _Runner:
    """One rank's state while it walks its order: what each forward keeps until its backward, and what its
    stages hand each other."""

    def __init__(self, schedule: str, steps: Steps, p2p: StageP2P, sync: GradSync, p: int, r: int):
        self.steps, self.p2p, self.sync, self.p = steps, p2p, sync, p
        self.chunk_of = {stage: c for c, stage in enumerate(stages_of(schedule, p, r))}
        self.last_stage, self.m = p * len(self.chunk_of) - 1, len(steps.micro_batches)
        self.kept: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}  # F's (input, output)
        self.handed: dict[tuple[str, int, int], torch.Tensor] = {}  # ("F" or "B", stage, i): from the other stage

    def forward(self, stage: int, i: int) -> None:
        if stage == 0:
            input_tensor = None
        elif stage - 1 in self.chunk_of:
            input_tensor = self.handed.pop(("F", stage, i))
        else:
            input_tensor = self.p2p.recv_activation(rank_of_stage(stage - 1, self.p))
        output = self.steps.forward(i, input_tensor, chunk=self.chunk_of[stage])
        if stage + 1 in self.chunk_of:
            self.handed[("F", stage + 1, i)] = output.detach().requires_grad_()
        elif stage < self.last_stage:
            self.p2p.send_activation(output, rank_of_stage(stage + 1, self.p))
        self.kept[(stage, i)] = (input_tensor, output)

    def backward(self, kind: str, stage: int, i: int) -> None:
        """I or B."""
        if stage == self.last_stage:
            output_grad = None  # the output is the loss
        elif stage + 1 in self.chunk_of:
            output_grad = self.handed.pop(("B", stage, i))
        else:
            output_grad = self.p2p.recv_gradient(rank_of_stage(stage + 1, self.p))
        input_tensor, output = self.kept.pop((stage, i))
        run = self.steps.backward if kind == "B" else self.steps.backward_input
        with self._sync_if(i == self.m - 1):
            input_grad = run(i, input_tensor, output, output_grad, chunk=self.chunk_of[stage])
        if stage - 1 in self.chunk_of:
            self.handed[("B", stage - 1, i)] = input_grad
        elif stage > 0:
            self.p2p.send_gradient(input_grad, rank_of_stage(stage - 1, self.p))

    def weight(self, stage: int, i: int) -> None:
        with self._sync_if(i == self.m - 1):
            self.steps.backward_weight(i, chunk=self.chunk_of[stage])

    @contextlib.contextmanager
    def _sync_if(self, last: bool) -> Iterator[None]:
        """The DP wrapper's sync on around a chunk's last micro-batch's backward step, off after any step."""
        if last:
            self.sync.enable()
        try:
            yield
        finally:
            self.sync.disable()

    def run(self, action: Action) -> None:
        if action.kind == "F":
            self.forward(action.stage, action.micro_batch)
        elif action.kind == "W":
            self.weight(action.stage, action.micro_batch)
        else:
            self.backward(action.kind, action.stage, action.micro_batch)


def run_zero_bubble(schedule: str, steps: Steps, p2p: StageP2P, sync: GradSync, p: int, r: int) -> None:
    """Run rank r's order of `schedule` on its stages (steps.chunks in the order of zero_bubble.stages_of)."""
    order: list[Action | Overlap] = rank_order(schedule, p, r, len(steps.micro_batches))
    runner = _Runner(schedule, steps, p2p, sync, p, r)
    sync.disable()
    for action in flat(order):
        runner.run(action)
    sync.enable()
    p2p.wait_sends()

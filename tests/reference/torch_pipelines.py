"""torch.distributed.pipelining's schedules stepping the reference's own GPT chunks: the oracle that the pipeline
tests and benchmarks/bench_zero_bubble.py run beside the reference, on the same chunks, weights and micro-batches."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import pipelining

TORCH_SCHEDULES = {  # the reference's zero-bubble schedules and torch's class of each
    "zb-h1": pipelining.ScheduleInterleavedZeroBubble,  # at one stage per rank
    "zbv": pipelining.ScheduleZBVZeroBubble,
    "dualpipev": pipelining.ScheduleDualPipeV,
}


class TorchChunk(torch.nn.Module):
    """A reference chunk with torch.distributed.pipelining's calling convention: the first takes the tokens,
    the others the received hidden state; the labels come as a keyword (split per micro-batch by torch). The
    last returns its loss as a 1-element tensor, which torch can concatenate into the step's output."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x, labels):
        out = self.chunk(x, labels) if self.chunk.is_first else self.chunk(None, labels, hidden=x)
        return out.reshape(1) if self.chunk.is_last else out


def torch_schedule(schedule: str, chunks: Sequence[torch.nn.Module], stages: Sequence[int], group, m: int):
    """torch's schedule of `schedule` over this rank's `chunks`, which are the global `stages` of p x len(stages).
    The loss is the chunk's own (summed to a scalar); torch divides the gradients by m as the reference does."""
    total = group.size() * len(stages)
    device = next(chunks[0].parameters()).device
    torch_stages = [
        pipelining.PipelineStage(TorchChunk(chunk), stage, total, device, group=group)
        for chunk, stage in zip(chunks, stages, strict=True)
    ]
    return TORCH_SCHEDULES[schedule](torch_stages, m, loss_fn=lambda loss, _target: loss.sum())


def step_torch(schedule, tokens: torch.Tensor, stages: Sequence[int], p: int) -> list[torch.Tensor]:
    """One step of torch's `schedule` on the global batch `tokens`: the micro-batch losses where this rank holds
    the last stage, else []."""
    losses: list[torch.Tensor] = []
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    first, last = 0 in stages, p * len(stages) - 1 in stages
    schedule.step(*([inputs] if first else []), labels=labels, **({"target": labels, "losses": losses} if last else {}))
    return losses

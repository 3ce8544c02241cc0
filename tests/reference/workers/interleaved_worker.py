"""Interleaved 1F1B (reference.pipeline.interleaved) at world 4, against the unsharded GPT and torch's own schedule.

Usage: interleaved_worker.py OUT_DIR (4 ranks). Each rank writes OUT_DIR/rank<r>.json with:
  * "runs": per layout (tp, pp, dp, v, m), two SGD steps of reference.gpt.train.train_step on v model chunks per
    stage: the largest differences of the losses and final weights from the single-process UnshardedGPT on the
    same seed and data, and the last step's action order, peaks of chunk-forwards in flight (as the schedule
    counts them and as autograd keeps them) and the DP all-reduces against the backward of each chunk's last
    micro-batch;
  * "torch": per m, torch.distributed.pipelining.ScheduleInterleaved1F1B on the same chunks (pp 4, v 2):
    its planned compute actions for this rank and its losses and gradients after one step, next to the
    reference's from the same initial weights.
test_interleaved.py asserts on them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from common import full_stage_parameters, groups_of_the_block, serve, unsharded_gpt_training

from reference.gpt.model import GPTConfig
from reference.gpt.parallelize import build_chunks
from reference.gpt.train import data_parallel, split_batch, synthetic_batches, train_step
from reference.measure.pipeline_meter import PipelineMeter
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout

CONFIG = GPTConfig(vocab_size=51, hidden_size=16, num_attention_heads=4, num_layers=8, seq_length=8)
SEED, STEPS, LR = 1234, 2, 0.5
# (tp, pp, dp, virtual stages, micro-batches), micro-batch size 1
LAYOUTS = [(1, 4, 1, 2, 4), (1, 4, 1, 2, 8), (1, 2, 2, 2, 4), (1, 2, 2, 4, 2), (2, 2, 1, 2, 4)]
TORCH_M = (4, 8)


@groups_of_the_block()  # each layout's groups go with it
def run(tp: int, pp: int, dp: int, v: int, m: int) -> dict:
    layout = build_layout(tp, pp, dp)
    chunks = build_chunks(CONFIG, layout, v, sequence_parallel=tp > 1, seed=SEED)
    model = [data_parallel(chunk, layout, bucket_size=4096) for chunk in chunks]
    optimizer = torch.optim.SGD([p for chunk in model for p in chunk.parameters()], lr=LR)
    expected_losses, _, expected_weights = unsharded_gpt_training(CONFIG, SEED, STEPS, LR, dp * m)
    losses, recorder, result = [], CollectiveRecorder(), PipelineMeter()
    for tokens in synthetic_batches(CONFIG, STEPS, dp * m, SEED):
        recorder.clear()
        losses.append(
            train_step(model, optimizer, tokens, layout, num_micro_batches=m, record=recorder, observer=result)
        )
    weights = {
        name: tensor
        for chunk in chunks
        for name, tensor in full_stage_parameters(chunk, layout.tp_group, CONFIG.vocab_size).items()
    }
    dp_ranks = tuple(dist.get_process_group_ranks(layout.dp_group))
    reduces = [e.start for e in recorder.events if e.op == "all_reduce" and e.group_ranks == dp_ranks]
    last_backwards = {
        a.split(".")[0][1:]: span
        for a, span in zip(result.actions, result.action_spans)
        if a.startswith("B") and a.endswith(f".{m - 1}")
    }
    return {
        "layout": [tp, pp, dp],
        "v": v,
        "m": m,
        "pp_rank": layout.pp_rank,
        "actions": result.actions,
        "peak": result.peak_in_flight,
        "peak_measured": result.peak_in_flight_measured,
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses, expected_losses)),
        "max_weight_diff": max((weights[n] - expected_weights[n]).abs().max().item() for n in weights),
        "dp_reduces": len(reduces) if dp > 1 else 0,
        "dp_reduces_outside_last_backwards": sum(
            not any(s <= t < e for s, e in last_backwards.values()) for t in reduces
        )
        if dp > 1
        else 0,
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


@groups_of_the_block()
def torch_oracle(m: int) -> dict:
    """torch's ScheduleInterleaved1F1B and the reference on the same chunks (pp 4, v 2), one step each."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import _ComputationType

    from reference.pipeline.schedules import forward_backward

    layout, v = build_layout(1, 4, 1), 2
    tokens = synthetic_batches(CONFIG, 1, m, SEED)[0]
    ours = build_chunks(CONFIG, layout, v, seed=SEED)
    result = PipelineMeter()
    our_losses = forward_backward(
        "1f1b",
        ours,
        split_batch(tokens, 1, 0, m),
        pp_group=layout.pp_group,
        activation_shape=ours[0].activation_shape(1),
        observer=result,
    )
    theirs = build_chunks(CONFIG, layout, v, seed=SEED)
    stages = [
        PipelineStage(TorchChunk(chunk), c * 4 + layout.pp_rank, 4 * v, torch.device("cpu"), group=layout.pp_group)
        for c, chunk in enumerate(theirs)
    ]
    schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=lambda loss, _target: loss.sum())
    losses = []
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    last = layout.pp_rank == 3
    kwargs = {"target": labels, "losses": losses} if last else {}
    if layout.pp_rank == 0:
        schedule.step(inputs, labels=labels, **kwargs)
    else:
        schedule.step(labels=labels, **kwargs)
    names = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    plan = [
        f"{names[a.computation_type]}{a.stage_index // 4}.{a.microbatch_index}"
        for a in schedule.pipeline_order[layout.pp_rank]
        if a is not None and a.computation_type in names
    ]
    grad_diff = max(
        (a.grad - b.grad).abs().max().item()
        for x, y in zip(ours, theirs)
        for a, b in zip(x.parameters(), y.parameters())
    )
    return {
        "m": m,
        "pp_rank": layout.pp_rank,
        "actions": result.actions,
        "torch_actions": plan,
        "losses": our_losses,
        "torch_losses": [loss.item() for loss in losses],
        "max_grad_diff": grad_diff,
    }


def results(_device: torch.device) -> dict:
    """Every layout's run and torch's schedule on the same chunks (CPU only: see reference.pipeline.p2p.RingP2P)."""
    assert dist.get_world_size() == 4, "run on 4 ranks"
    return {"runs": [run(*layout) for layout in LAYOUTS], "torch": [torch_oracle(m) for m in TORCH_M]}


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()

"""Worker for test_tied_embeddings.py: `torchrun --nproc-per-node 4 tied_embeddings_worker.py OUTDIR` (or in a
shared launch, workers/shared_worker.py).

Trains the small GPT with tied input and output embeddings (GPTConfig.share_embeddings_and_output_weights)
for three SGD steps at PP 2 x DP 2 and at PP 2 x TP 2, next to the unsharded tied GPT on the same global
batches. Each rank writes OUTDIR/rank{r}.json per layout: its stage, losses, the step-1 gradient of the tied
matrix after finalize_model_grads and the final matrix (this rank's TP shard gathered over TP, cut to the
vocabulary), the first stage's and the last stage's copies' largest difference, and the recorded all-reduces
on the embedding group; and, as a negative control, PP 2 x DP 2 finalized without the embedding group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from common import gather_dim, serve, unsharded_gpt_training

from reference.data_parallel import finalize_model_grads
from reference.gpt.model import GPTConfig
from reference.gpt.parallelize import build_stage
from reference.gpt.train import data_parallel, synthetic_batches, train_step
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.pipeline.tied_embeddings import embedding_group, shared_weight, tie_across_stages

CONFIG = GPTConfig(
    vocab_size=51,
    hidden_size=16,
    num_attention_heads=4,
    num_layers=2,
    seq_length=8,
    share_embeddings_and_output_weights=True,
)
B, M, STEPS, SEED, LR = 2, 2, 3, 7, 0.5


def unsharded(global_batch: int) -> dict:
    run = unsharded_gpt_training(CONFIG, SEED, STEPS, LR, global_batch)
    # named_parameters lists a shared Parameter once: under the embedding's name, the output layer's is the same
    assert "output_layer.weight" not in run.weights, "the unsharded oracle's output weight is not tied"
    name = "embedding.word_embeddings.weight"
    return {"losses": run.losses, "grad": run.first_grads[name], "weight": run.weights[name]}


def full_rows(t: torch.Tensor, layout) -> torch.Tensor:
    """The whole [V, h] matrix from this rank's vocabulary shard (padding rows dropped)."""
    return gather_dim(t.detach(), 0, layout.tp_group)[: CONFIG.vocab_size]


def run(tp: int, pp: int, dp: int, sum_embedding_grads: bool = True) -> dict:
    """sum_embedding_grads=False: the negative control, finalize without the embedding group."""
    layout = build_layout(tp, pp, dp)
    group = embedding_group(layout)
    stage = build_stage(CONFIG, layout, seed=SEED)
    tie_across_stages(stage, group)
    model = data_parallel(stage, layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    weight, grads, losses, events = shared_weight(stage), [], [], []

    def finalize():
        finalize_model_grads([model], layout.tp_group, embedding_group=group if sum_embedding_grads else None)
        grads.append(full_rows(weight.grad, layout).clone())

    group_ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else None
    for tokens in synthetic_batches(CONFIG, STEPS, B * M * dp, SEED):
        recorder = CollectiveRecorder()
        losses.append(
            train_step(model, optimizer, tokens, layout, num_micro_batches=M, record=recorder, finalize_grads=finalize)
        )
        events.append([e.nbytes for e in recorder.events if e.op == "all_reduce" and e.group_ranks == group_ranks])
    final = full_rows(weight, layout)
    other = final.clone()  # the other end's copy, through the embedding group
    if group is not None:
        peers = [torch.empty_like(final) for _ in range(2)]
        dist.all_gather(peers, final, group=group)
        other = peers[1] if stage.is_first else peers[0]
    oracle = unsharded(B * M * dp)
    return {
        "pp_rank": layout.pp_rank,
        "embedding_group": list(group_ranks) if group_ranks else None,
        "losses": losses,
        "oracle_losses": oracle["losses"],
        "grad_diff": (grads[0] - oracle["grad"]).abs().max().item(),
        "weight_diff": (final - oracle["weight"]).abs().max().item(),
        "ends_equal": torch.equal(final, other),
        "embedding_all_reduces": events,
        "shard_bytes": weight.numel() * weight.element_size(),
    }


def results(_device: torch.device) -> dict:
    """Both tied layouts and the negative control (CPU)."""
    assert dist.get_world_size() == 4, "run on 4 ranks"
    return {
        "rank": dist.get_rank(),
        "pp2_dp2": run(tp=1, pp=2, dp=2),
        "pp2_tp2": run(tp=2, pp=2, dp=1),
        "pp2_dp2/no_sum": run(tp=1, pp=2, dp=2, sum_embedding_grads=False),
    }


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()

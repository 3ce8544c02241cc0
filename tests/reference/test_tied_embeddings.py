"""Tied input and output embeddings across the first and last pipeline stage (reference.pipeline.tied_embeddings,
Megatron's share_embeddings_and_output_weights): at world 4 every rank trains the small tied GPT (vocabulary 51:
padded to 52 under TP 2) for three SGD steps at PP 2 x DP 2 and PP 2 x TP 2 against the unsharded tied GPT, and
once without the embedding-gradient all-reduce (`results()`, once a rank); the tests compare every rank's record."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from reference.data_parallel import finalize_model_grads
from reference.gpt.model import GPTConfig
from reference.gpt.parallelize import build_stage
from reference.gpt.train import data_parallel, synthetic_batches, train_step
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.pipeline.tied_embeddings import embedding_group, shared_weight, tie_across_stages
from tests.ranks import on_ranks
from tests.reference.helpers import every_rank, gather_dim, groups_of_the_block, unsharded_gpt_training

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


@functools.cache
def results() -> list[dict]:
    """Both tied layouts and the negative control (CPU) on this rank, computed once a rank; every rank's, gathered."""
    with groups_of_the_block():
        mine = {
            "rank": dist.get_rank(),
            "pp2_dp2": run(tp=1, pp=2, dp=2),
            "pp2_tp2": run(tp=2, pp=2, dp=1),
            "pp2_dp2/no_sum": run(tp=1, pp=2, dp=2, sum_embedding_grads=False),
        }
    return every_rank(mine)


FP32 = 1e-7  # observed <= 3e-8: the batch split changes the fp32 summation order


@on_ranks(4)
@pytest.mark.parametrize("layout", ["pp2_dp2", "pp2_tp2"])
def test_tied_pipeline_trains_like_the_unsharded_tied_gpt(ranks, layout):
    """Loss of every step, the tied matrix's gradient after finalize_model_grads (the sum of both uses) and the
    matrix after three steps equal the unsharded model's, on both ends of the pipeline."""
    for result in results():
        run = result[layout]
        assert max(abs(a - b) for a, b in zip(run["losses"], run["oracle_losses"])) < 1e-6
        assert run["grad_diff"] <= FP32 and run["weight_diff"] <= FP32
        assert run["ends_equal"], "the first stage's embedding and the last stage's output weight are one matrix"


@on_ranks(4)
@pytest.mark.parametrize("layout, groups", [("pp2_dp2", [[0, 1], [2, 3]]), ("pp2_tp2", [[0, 2], [1, 3]])])
def test_embedding_group_pairs_the_ends_and_all_reduces_once_per_step(ranks, layout, groups):
    """The embedding group holds the first- and last-stage ranks of one DP and TP coordinate; each step it
    all-reduces the gradient of this rank's vocabulary shard once (fp32: 51 x 16 x 4 B, or 26 x 16 x 4 B at
    TP 2), in finalize_model_grads."""
    shard = {"pp2_dp2": 51 * 16 * 4, "pp2_tp2": 26 * 16 * 4}[layout]
    for result in results():
        run = result[layout]
        assert run["embedding_group"] in groups
        assert run["shard_bytes"] == shard and run["embedding_all_reduces"] == [[shard]] * 3


@on_ranks(4)
def test_without_the_gradient_sum_the_two_copies_drift_apart(ranks):
    for result in results():
        run = result["pp2_dp2/no_sum"]
        assert not run["ends_equal"] and run["weight_diff"] > 1e-4 and run["embedding_all_reduces"] == [[]] * 3

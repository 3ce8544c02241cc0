"""Tied input and output embeddings across the first and last pipeline stage (reference.pipeline.tied_embeddings,
Megatron's share_embeddings_and_output_weights): one 4-rank launch of workers/tied_embeddings_worker.py trains the
small tied GPT (vocabulary 51: padded to 52 under TP 2) for three SGD steps at PP 2 x DP 2 and PP 2 x TP 2
against the unsharded tied GPT, and once without the embedding-gradient all-reduce."""

from __future__ import annotations

import pytest

from tests.launch import run_worker

FP32 = 1e-7  # observed <= 3e-8: the batch split changes the fp32 summation order


def results() -> list[dict]:
    return run_worker("tied_embeddings_worker.py", 4, timeout=300)


@pytest.mark.parametrize("layout", ["pp2_dp2", "pp2_tp2"])
def test_tied_pipeline_trains_like_the_unsharded_tied_gpt(layout):
    """Loss of every step, the tied matrix's gradient after finalize_model_grads (the sum of both uses) and the
    matrix after three steps equal the unsharded model's, on both ends of the pipeline."""
    for result in results():
        run = result[layout]
        assert max(abs(a - b) for a, b in zip(run["losses"], run["oracle_losses"])) < 1e-6
        assert run["grad_diff"] <= FP32 and run["weight_diff"] <= FP32
        assert run["ends_equal"], "the first stage's embedding and the last stage's output weight are one matrix"


@pytest.mark.parametrize("layout, groups", [("pp2_dp2", [[0, 1], [2, 3]]), ("pp2_tp2", [[0, 2], [1, 3]])])
def test_embedding_group_pairs_the_ends_and_all_reduces_once_per_step(layout, groups):
    """The embedding group holds the first- and last-stage ranks of one DP and TP coordinate; each step it
    all-reduces the gradient of this rank's vocabulary shard once (fp32: 51 x 16 x 4 B, or 26 x 16 x 4 B at
    TP 2), in finalize_model_grads."""
    shard = {"pp2_dp2": 51 * 16 * 4, "pp2_tp2": 26 * 16 * 4}[layout]
    for result in results():
        run = result[layout]
        assert run["embedding_group"] in groups
        assert run["shard_bytes"] == shard and run["embedding_all_reduces"] == [[shard]] * 3


def test_without_the_gradient_sum_the_two_copies_drift_apart():
    for result in results():
        run = result["pp2_dp2/no_sum"]
        assert not run["ends_equal"] and run["weight_diff"] > 1e-4 and run["embedding_all_reduces"] == [[]] * 3

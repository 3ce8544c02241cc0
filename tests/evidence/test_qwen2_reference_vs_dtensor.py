"""The reference's Llama/Qwen2 block against PyTorch's DTensor plans on Hugging Face's Qwen2, per block and
phase, on every rank of the runs the oracle tests already made there (test_qwen2_oracle.results,
test_qwen2_dtensor.run_tp, cached per rank): the same forward collectives, and a backward that differs exactly
where the two designs do."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.evidence.test_qwen2_dtensor import run_tp
from tests.ranks import on_ranks
from tests.reference.test_qwen2_oracle import block_ops
from tests.reference.test_qwen2_oracle import results as reference_results

pytestmark = pytest.mark.upstream("pytorch")

PLANS = {"tp": "tp", "tp_sp": "sp"}  # the reference's configuration -> the document's DTensor plan


def per_block(ranks, config: str, phase: str) -> tuple[dict, dict]:
    """(reference, DTensor) collective counts of one block in `phase`, on this rank of each TP-2 run."""
    reference = dict(Counter(op for op, _, _ in block_ops(reference_results(ranks.device)[config], phase)))
    blocks = run_tp(ranks.device)[PLANS[config]]["blocks"]
    assert all(block == blocks[0] for block in blocks)  # every decoder layer the same
    return reference, blocks[0][phase]


@on_ranks(2)
@pytest.mark.parametrize("config", PLANS)
def test_forward_collectives_per_block_are_the_dtensor_plans(ranks, config):
    reference, dtensor = per_block(ranks, config, "forward")
    assert reference == dtensor


@on_ranks(2)
def test_without_sp_dtensor_reduces_each_column_layers_input_gradient_on_its_own(ranks):
    """Megatron (and the reference) fuse q, k, v into one column layer and gate, up into another: 2 backward
    all-reduces; the plan shards 5 separate linears, each a Replicate input with a Partial gradient: 5."""
    reference, dtensor = per_block(ranks, "tp", "backward")
    assert reference == {"all_reduce": 2} and dtensor == {"all_reduce": 5}


@on_ranks(2)
def test_under_sp_the_reference_regathers_the_column_inputs_for_the_weight_gradients(ranks):
    """Backward mirrors forward in both (an all-gather per forward reduce-scatter, a reduce-scatter per forward
    all-gather); the reference, as Megatron's column layers, also all-gathers each column layer's input again
    for its weight gradient instead of keeping the gathered input: 2 more all-gathers per block."""
    reference, dtensor = per_block(ranks, "tp_sp", "backward")
    assert dtensor == {"all_gather": 2, "reduce_scatter": 2}
    assert reference == {"all_gather": 4, "reduce_scatter": 2}

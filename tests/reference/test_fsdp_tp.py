"""FSDP x TP (reference.data_parallel.fsdp_tp) on 4 ranks = TP 2 x DP 2, CPU/gloo.

One launch of workers/fsdp_tp_worker.py trains the 2-layer test transformer (hidden 12, 2 heads) for three SGD
steps as reference FSDP over the DP group of TP-sharded blocks, with and without sequence parallelism, next to
single-process training and PyTorch's FSDP2 (`fully_shard` on the "dp" mesh dimension) over DTensor TP
(`parallelize_module`) on a 2D DeviceMesh whose groups are the layout's.
"""

from __future__ import annotations

import pytest

from tests.launch import run_worker

FP32 = 1e-7  # observed <= 3.8e-9 against both oracles
# One block's TP-local parameters (fp32 elements): ln1 12+12, qkv 18x12+18, proj 12x6+12, ln2 12+12,
# fc1 24x12+24, fc2 12x24+12 = 978; qkv.bias ends off a 16-byte boundary, so the flat buffer is 980 (FSDP1's
# alignment), which dp=2 divides: each rank keeps 490 elements.
UNIT_PARAM_NUMEL, UNIT_NUMEL = 978, 980
DP = 2


def results() -> list[dict]:
    return run_worker("fsdp_tp_worker.py", 4, timeout=240)


def on(events: list[dict], group: list[int]) -> list[tuple]:
    return [(e["op"], e["phase"], e["nbytes"]) for e in events if e["group"] == group]


@pytest.mark.parametrize("config", ["plain", "sp"])
def test_training_equals_single_process(config):
    for result in results():
        assert result["diff"][f"{config}/single"] <= FP32, result["rank"]
        assert result["loss_diff"][f"{config}/single"] <= 1e-6


@pytest.mark.parametrize("config", ["plain", "sp"])
def test_matches_fsdp2_over_dtensor_tp_on_a_2d_mesh(config):
    for result in results():
        assert result["diff"][f"fsdp2_{config}/single"] <= FP32  # the oracle itself trains correctly
        assert result["diff"][f"{config}/fsdp2"] <= FP32, result["rank"]
        assert result["loss_diff"][f"{config}/fsdp2"] == 0.0  # observed: the same losses, bit for bit


@pytest.mark.parametrize("config", ["plain", "sp"])
def test_dp_group_carries_fsdp_all_gathers_and_reduce_scatters_of_the_tp_sharded_unit(config):
    unit_bytes = UNIT_NUMEL * 4  # recorded as the full gathered / unreduced buffer; each rank sends 1/dp of it
    for result in results():
        assert [
            (u["param_numel"], u["numel"], u["padded_numel"], u["shard_numel"]) for u in result[config]["units"]
        ] == [(UNIT_PARAM_NUMEL, UNIT_NUMEL, UNIT_NUMEL, UNIT_NUMEL // DP)] * 2
        for step, theirs in zip(result[config]["steps"], result[config]["fsdp2_steps"]):
            # per block: an all-gather before forward, one before backward, a reduce-scatter after backward
            assert (
                on(step, result["dp_group"])
                == [("all_gather", "forward", unit_bytes)] * 2
                + [("all_gather", "backward", unit_bytes)] * 2
                + [("reduce_scatter", "backward", unit_bytes)] * 2
            )
            # FSDP2 issues the same schedule; it shards each parameter on dim 0 (no alignment padding): 978
            assert on(theirs, result["dp_group"]) == [
                (op, phase, UNIT_PARAM_NUMEL * 4) for op, phase, _ in on(step, result["dp_group"])
            ]


@pytest.mark.parametrize("config", ["plain", "sp"])
def test_tp_group_carries_the_tp_only_models_collectives(config):
    for result in results():
        tp = result["tp_group"]
        tp_only = on(result[config]["tp_only"], tp)
        for step, theirs in zip(result[config]["steps"], result[config]["fsdp2_steps"]):
            ours = on(step, tp)
            assert (ours[:-1] if config == "sp" else ours) == tp_only
            if config == "plain":  # DTensor TP: the same 2 all-reduces per block each way
                assert (
                    on(theirs, tp)
                    == tp_only
                    == [("all_reduce", "forward", 768)] * 4 + [("all_reduce", "backward", 768)] * 4
                )


def test_sequence_parallel_grads_are_summed_over_tp_on_the_sharded_gradients():
    """After FSDP's reduce-scatter each rank holds 1/dp of the flat gradient: the TP all-reduce of the
    LayerNorm and row-bias gradients sends only their part of this rank's shard. Block layout: ln1, proj.bias,
    ln2 (5 x 12 floats) lie in the first half (DP rank 0), fc2.bias (12) in the second (DP rank 1)."""
    sent = {}
    for result in results():
        for step in result["sp"]["steps"]:
            last = step[-1]
            assert (last["op"], last["group"], last["phase"]) == ("all_reduce", result["tp_group"], "forward")
            sent[result["rank"]] = last["nbytes"]
    assert sent == {0: 2 * 5 * 12 * 4, 1: 2 * 5 * 12 * 4, 2: 2 * 1 * 12 * 4, 3: 2 * 1 * 12 * 4}
    assert sent[0] + sent[2] == 2 * 6 * 12 * 4  # over the DP group: every SP gradient once


def test_bad_input_gets_one_line_errors_on_every_rank():
    for result in results():
        assert result["bad_input"] == {
            "unsharded_model": "shard_tp_model: rank 0: Transformer has no tensor-parallel block to wrap; "
            "split it first with reference.tensor_parallel.parallelize.parallelize(model, layout)",
            "full_weight": "shard_tp_model: rank 0: layers.0.attention.qkv.weight has shape [36, 12], expected "
            "[18, 12]: a TP-sharded layer must hold this rank's 1/2 slice, not the full weight",
            "uneven_plain_parameter": "shard_tp_model: parameter shapes differ between ranks 0 and 1 of TP group "
            "[0, 1] (first: 'layers.0.extra' [5]); FSDP x TP needs one flat layout per "
            "TP and per DP group",
        }

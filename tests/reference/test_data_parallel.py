"""Reference DDP (reference.data_parallel) against single-process training and torch's DistributedDataParallel.

One 4-rank launch of workers/data_parallel_worker.py trains the 2-layer test transformer (hidden 16) for three
SGD steps at DP=4, DP=2 (two independent pairs) and TP=2 x DP=2 (with and without sequence parallelism), and
with torch DDP on the same groups; the pytest functions below read what each rank observed. The DP=2 run
clears gradients with `optimizer.zero_grad()` (set to None: the hooks move autograd's fresh gradient into the
bucket), the others with `DistributedDataParallel.zero_grad()` (the buckets are zeroed in place).
"""

from __future__ import annotations

import pytest

from tests.launch import run_worker

FP32 = 1e-7  # observed <= 7.5e-9 on parameters and gradients: the batch-split summation order
# Buckets at bucket_size=4096 bytes, filled from the last parameter back and closed at >= 4096 bytes. Per block
# (fp32 bytes): ln1 64+64, qkv 3072+192, proj 1024+64, ln2 64+64, fc1 4096+256, fc2 4096+64. So: fc2.bias +
# fc2.weight = 4160 | fc1 = 4352 | ln2 + proj + qkv = 4480 | layer-1 ln1 + layer-0 fc2 = 4288 | 4352 | 4480 |
# layer-0 ln1 = 128.
DP_BUCKETS = [4160, 4352, 4480, 4288, 4352, 4480, 128]
# TP=2 halves qkv, fc1 (rows, bias) and proj, fc2 (columns): fc2 + fc1 = 4288 | ln2 + proj + qkv + ln1 +
# layer-0 fc2 = 4576 | layer-0 fc1 + ln2 + proj + qkv = 4512 | layer-0 ln1 = 128.
TP_DP_BUCKETS = [4288, 4576, 4512, 128]


def results() -> list[dict]:
    return run_worker("data_parallel_worker.py", 4, timeout=240)


def all_reduces(step: list[dict], group: list[int]) -> list[dict]:
    return [e for e in step if e["op"] == "all_reduce" and e["group"] == group]


@pytest.mark.parametrize("run", ["dp4", "dp2", "tp2dp2", "tp2dp2/sp", "dp4/no_overlap", "dp4/one_bucket"])
def test_training_equals_single_process_on_the_global_batch(run):
    for result in results():
        assert result["diff"][f"{run}/single_grads"] <= FP32, (run, result["rank"])
        assert result["diff"][f"{run}/single"] <= FP32, (run, result["rank"])
        assert result["loss_diff"][run] <= 1e-6


@pytest.mark.parametrize("dp", ["dp2", "dp4"])
def test_gradients_and_parameters_equal_torch_ddp(dp):
    for result in results():
        assert result["diff"][f"{dp}/torch_grads"] <= FP32 and result["diff"][f"{dp}/torch"] <= FP32
    # two ranks sum in one order whatever the bucket boundaries: bitwise equal
    assert all(r["diff"]["dp2/torch"] == r["diff"]["dp2/torch_grads"] == 0.0 for r in results())


def test_bucket_layout_is_one_all_reduce_per_bucket_of_the_computed_size():
    for result in results():
        assert sum(result["param_bytes"]) == sum(DP_BUCKETS) == result["buckets"]["dp4/one_bucket"][0]
        assert result["buckets"]["dp4"] == result["buckets"]["torch_assignment"] == DP_BUCKETS
        assert result["buckets"]["tp2dp2"] == result["buckets"]["tp2dp2/sp"] == TP_DP_BUCKETS
        for run, group, expected in [
            ("dp4", [0, 1, 2, 3], DP_BUCKETS),
            ("dp4/no_overlap", [0, 1, 2, 3], DP_BUCKETS),
            ("dp4/one_bucket", [0, 1, 2, 3], [sum(DP_BUCKETS)]),
            ("dp2", [0, 1] if result["rank"] < 2 else [2, 3], DP_BUCKETS),
            ("tp2dp2", result["dp_group"], TP_DP_BUCKETS),
            ("tp2dp2/sp", result["dp_group"], TP_DP_BUCKETS),
        ]:
            for step in result["steps"][run]:
                assert [e["nbytes"] for e in all_reduces(step, group)] == expected, (run, result["rank"])


def test_bucket_layout_equals_torch_ddp_after_its_rebuild_in_gradient_order():
    """torch's Reducer starts from a forward-order assignment and rebuilds its buckets from the order the
    gradients arrived in during step 1; from step 2 on its all-reduces are ours, byte for byte."""
    for result in results():
        for run, group in [("torch_dp4", [0, 1, 2, 3]), ("torch_dp2", [0, 1] if result["rank"] < 2 else [2, 3])]:
            for step in result["steps"][run][1:]:
                assert [e["nbytes"] for e in all_reduces(step, group)] == DP_BUCKETS


def test_overlap_issues_every_bucket_but_the_last_during_backward_before_the_last_gradient():
    for result in results():
        for step in result["steps"]["dp4"]:
            assert [(e["phase"], e["before_last_gradient"]) for e in step] == (
                [("backward", True)] * (len(DP_BUCKETS) - 1) + [("backward", False)]
            )
        for step in result["steps"]["dp4/no_overlap"]:  # all issued by finish_grad_sync, after backward
            assert [(e["phase"], e["before_last_gradient"]) for e in step] == [("forward", False)] * len(DP_BUCKETS)


def test_tp_x_dp_reduces_shards_on_the_dp_group_and_keeps_the_tp_collectives():
    for result in results():
        dp, tp = result["dp_group"], result["tp_group"]
        assert dp == [result["rank"] % 2, result["rank"] % 2 + 2] and tp == [
            result["rank"] // 2 * 2,
            result["rank"] // 2 * 2 + 1,
        ]
        plain, sp = result["steps"]["tp2dp2"][0], result["steps"]["tp2dp2/sp"][0]
        assert {e["group"] == dp or e["group"] == tp for e in plain + sp} == {True}
        # TP as the TP-only model (2 layers: 2 all-reduces per block each way); DP bucket all-reduces
        # interleave with the backward TP all-reduces (overlap across both groups)
        assert [e["phase"] for e in all_reduces(plain, tp)] == ["forward"] * 4 + ["backward"] * 4
        first_dp = plain.index(all_reduces(plain, dp)[0])
        assert any(e["group"] == tp for e in plain[first_dp:])
        # under SP, finalize_model_grads adds one TP all-reduce of the partial LayerNorm and row-bias grads:
        # 2 layers x (ln1, ln2: weight + bias; proj, fc2: bias) x 16 x 4 bytes, after the DP reduction
        assert sp[-1] == {
            "op": "all_reduce",
            "group": tp,
            "nbytes": 2 * 6 * 16 * 4,
            "phase": "forward",
            "before_last_gradient": False,
        }


def test_no_sync_accumulates_without_collectives_then_one_sync_equals_one_big_batch():
    for result in results():
        no_sync = result["no_sync"]
        assert no_sync["collectives_per_micro_batch"] == [0, len(DP_BUCKETS)]
        assert no_sync["diff_single"] <= FP32 and no_sync["diff_one_batch"] <= FP32


def test_bad_input_gets_one_line_errors():
    errors = results()[0]["bad_input"]
    assert errors == {
        "bucket_size_zero": "bucket_size must be a positive number of bytes or None (one bucket), got 0",
        "bucket_size_negative": "bucket_size must be a positive number of bytes or None (one bucket), got -5",
        "batch_not_divisible": "the global batch size (6) is not divisible by the data-parallel size (4)",
        "main_grad": "parameter 'layers.0.attention.qkv.weight' accumulates into main_grad "
        "(gradient_accumulation_fusion); reference DDP reduces .grad: build the model with "
        "gradient_accumulation_fusion=False",
        "grad_twice": "DistributedDataParallel: a parameter's gradient arrived twice in one synced step; run every "
        "backward but the last of a step under no_sync()",
        "collectives_after_remove_hooks": 0,
    }

"""Reference DDP (reference.data_parallel) against single-process training and torch's DistributedDataParallel.

At 4 CPU ranks, the first test to ask (`results()`, once a rank) trains the 2-layer test transformer (hidden
16) for three SGD steps at DP=4, DP=2 (two independent pairs) and TP=2 x DP=2 (with and without sequence
parallelism), and with torch DDP on the same groups; each test asserts on what its rank observed. The DP=2 run
clears gradients with `optimizer.zero_grad()` (set to None: the hooks move autograd's fresh gradient into the
bucket), the others with `DistributedDataParallel.zero_grad()` (the buckets are zeroed in place).
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist

from reference.data_parallel import DistributedDataParallel, finalize_model_grads, local_batch
from reference.gpt.model import gpt_blocks
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.tensor_parallel.parallelize import parallelize
from tests.ranks import on_ranks
from tests.reference import regression
from tests.reference.helpers import full_tensor, max_diff

H, HEADS, LAYERS, S, B, STEPS, SEED, LR = 16, 4, 2, 8, 8, 3, 1234, 0.1
DEVICE = torch.device("cpu")
BUCKET = 4096  # bytes: the 2-layer model (26,240 bytes) splits into 7 buckets


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return regression.batches(steps, S, B, H)


def train_ddp(
    group,
    *,
    tp_group=None,
    sequence_parallel=False,
    overlap=True,
    bucket_size=BUCKET,
    implementation="reference",
    steps=STEPS,
    optimizer_zero_grad=False,
) -> dict:
    """STEPS steps of DDP over `group` (TP-sharded when tp_group is given); what the tests read.
    optimizer_zero_grad: clear with `optimizer.zero_grad()` (grads set to None) instead of `model.zero_grad()`."""
    torch.manual_seed(SEED)
    if tp_group is None:
        module = gpt_blocks(LAYERS, H, HEADS, device=DEVICE)
    else:
        module = parallelize(gpt_blocks(LAYERS, H, HEADS, device=DEVICE), tp_group, sequence_parallel=sequence_parallel)
    gradient_stamps: list[float] = []
    for param in module.parameters():  # registered before DDP's hooks, so they fire first on each parameter
        param.register_post_accumulate_grad_hook(lambda _p: gradient_stamps.append(time.perf_counter()))
    if implementation == "torch":
        model = torch.nn.parallel.DistributedDataParallel(
            module, process_group=group, bucket_cap_mb_list=[bucket_size / 2**20]
        )
    else:
        model = DistributedDataParallel(module, group, bucket_size=bucket_size, overlap_grad_reduce=overlap)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, records, first_grads = [], [], None
    for x, target in batches(steps):
        gradient_stamps.clear()
        with CollectiveRecorder() as rec:  # the step's own collectives: not the test's gathers below
            out = model(None, None, hidden=local_batch(x, group, dim=1))
            loss = regression.mse(out, local_batch(target, group, dim=1))
            loss.backward()
            if implementation == "reference":
                finalize_model_grads([model], tp_group)
        last_gradient = max(gradient_stamps)
        records.append(
            [
                {
                    "op": e.op,
                    "group": list(e.group_ranks),
                    "nbytes": e.nbytes,
                    "phase": e.phase,
                    "before_last_gradient": e.start < last_gradient,
                }
                for e in rec.events
            ]
        )
        first_grads = first_grads or {n: full(n, p.grad, tp_group) for n, p in module.named_parameters()}
        optimizer.step()
        (optimizer if optimizer_zero_grad else model).zero_grad()
        losses.append(regression.mean_over(loss.item(), group))
    result = {
        "losses": losses,
        "steps": records,
        "first_grads": first_grads,
        "params": {n: full(n, p.detach(), tp_group) for n, p in module.named_parameters()},
    }
    if implementation == "reference":
        result["buckets"] = [bucket.nbytes for bucket in model.buckets]
    return result


def full(name: str, tensor: torch.Tensor, tp_group) -> torch.Tensor:
    if tp_group is None:
        return tensor.clone()
    module_name, param_name = name.rsplit(".", 1)
    return full_tensor(module_name, param_name, tensor, tp_group).clone()


def no_sync_run(group, micro_batches: int) -> dict:
    """One step as `micro_batches` accumulated micro-batches: all but the last under no_sync."""
    torch.manual_seed(SEED)
    module = gpt_blocks(LAYERS, H, HEADS, device=DEVICE)
    model = DistributedDataParallel(module, group, bucket_size=BUCKET)
    x, target = (local_batch(t, group, dim=1) for t in batches(1)[0])
    per_micro = []
    with CollectiveRecorder() as rec:
        for i, (xm, tm) in enumerate(zip(x.chunk(micro_batches, dim=1), target.chunk(micro_batches, dim=1))):
            rec.clear()
            if i < micro_batches - 1:
                with model.no_sync():
                    (regression.mse(model(None, None, hidden=xm), tm) / micro_batches).backward()
            else:
                (regression.mse(model(None, None, hidden=xm), tm) / micro_batches).backward()
                model.finish_grad_sync()
            per_micro.append(len(rec.events))
    return {
        "collectives_per_micro_batch": per_micro,
        "grads": {n: p.grad.clone() for n, p in module.named_parameters()},
    }


def bad_input(group, tp_group) -> dict[str, str]:
    errors = {}

    def capture(key, fn):
        try:
            fn()
        except (ValueError, RuntimeError) as error:
            errors[key] = str(error)

    capture(
        "bucket_size_zero",
        lambda: DistributedDataParallel(gpt_blocks(1, H, HEADS, device=DEVICE), group, bucket_size=0),
    )
    capture(
        "bucket_size_negative",
        lambda: DistributedDataParallel(gpt_blocks(1, H, HEADS, device=DEVICE), group, bucket_size=-5),
    )
    capture("batch_not_divisible", lambda: local_batch(torch.zeros(6, 2), group))
    fused = parallelize(gpt_blocks(1, H, HEADS, device=DEVICE), tp_group, gradient_accumulation_fusion=True)
    capture("main_grad", lambda: DistributedDataParallel(fused, group))
    twice = DistributedDataParallel(gpt_blocks(1, H, HEADS, device=DEVICE), group, bucket_size=None)
    x = torch.randn(S, 2, H)
    twice(None, None, hidden=x).sum().backward()  # the one bucket goes on the wire during this backward
    capture("grad_twice", lambda: twice(None, None, hidden=x).sum().backward())  # a second synced backward: refused
    twice.finish_grad_sync()
    twice.remove_hooks()
    with CollectiveRecorder() as rec:  # detached: backward neither communicates nor refuses
        twice(None, None, hidden=x).sum().backward()
        twice(None, None, hidden=x).sum().backward()
    errors["collectives_after_remove_hooks"] = len(rec.events)
    return errors


FP32 = 1e-7  # observed <= 7.5e-9 on parameters and gradients: the batch-split summation order
# Buckets at bucket_size=4096 bytes, filled from the last parameter back and closed at >= 4096 bytes. Per block
# (fp32 bytes): ln1 64+64, qkv 3072+192, proj 1024+64, ln2 64+64, fc1 4096+256, fc2 4096+64. So: fc2.bias +
# fc2.weight = 4160 | fc1 = 4352 | ln2 + proj + qkv = 4480 | layer-1 ln1 + layer-0 fc2 = 4288 | 4352 | 4480 |
# layer-0 ln1 = 128.
DP_BUCKETS = [4160, 4352, 4480, 4288, 4352, 4480, 128]
# TP=2 halves qkv, fc1 (rows, bias) and proj, fc2 (columns): fc2 + fc1 = 4288 | ln2 + proj + qkv + ln1 +
# layer-0 fc2 = 4576 | layer-0 fc1 + ln2 + proj + qkv = 4512 | layer-0 ln1 = 128.
TP_DP_BUCKETS = [4288, 4576, 4512, 128]


@functools.cache
def results() -> dict:
    """This rank's differences, recorded steps and buckets in every configuration, and the bad-input errors
    (computed once a rank: the tests read it)."""
    rank = dist.get_rank()
    losses, single_grads, single_params = regression.single_process(LAYERS, H, HEADS, SEED, LR, batches())
    layout = build_layout(tp_size=2)  # TP [0,1] [2,3], DP [0,2] [1,3]
    halves, _ = dist.new_subgroups(2)  # plain DP=2: [0,1] and [2,3], two independent replicas groups
    world_group = dist.group.WORLD
    runs = {
        "dp4": train_ddp(world_group),
        "dp4/no_overlap": train_ddp(world_group, overlap=False),
        "dp4/one_bucket": train_ddp(world_group, bucket_size=None),
        "dp2": train_ddp(halves, optimizer_zero_grad=True),
        "torch_dp4": train_ddp(world_group, implementation="torch"),
        "torch_dp2": train_ddp(halves, implementation="torch"),
        "tp2dp2": train_ddp(layout.dp_group, tp_group=layout.tp_group),
        "tp2dp2/sp": train_ddp(layout.dp_group, tp_group=layout.tp_group, sequence_parallel=True),
    }
    result = {
        "rank": rank,
        "dp_group": dist.get_process_group_ranks(layout.dp_group),
        "tp_group": dist.get_process_group_ranks(layout.tp_group),
        "diff": {},
        "loss_diff": {},
        "steps": {},
        "buckets": {},
    }
    for name, run in runs.items():
        result["diff"][f"{name}/single"] = max_diff(run["params"], single_params)
        result["diff"][f"{name}/single_grads"] = max_diff(run["first_grads"], single_grads)
        result["loss_diff"][name] = max(abs(a - b) for a, b in zip(run["losses"], losses))
        result["steps"][name] = run["steps"]
        result["buckets"][name] = run.get("buckets")
    for dp in ("dp4", "dp2"):
        result["diff"][f"{dp}/torch"] = max_diff(runs[dp]["params"], runs[f"torch_{dp}"]["params"])
        result["diff"][f"{dp}/torch_grads"] = max_diff(runs[dp]["first_grads"], runs[f"torch_{dp}"]["first_grads"])
    params = list(gpt_blocks(LAYERS, H, HEADS, device=DEVICE).parameters())
    torch_indices, _ = dist._compute_bucket_assignment_by_size(params[::-1], [BUCKET])
    result["buckets"]["torch_assignment"] = [sum(params[::-1][i].nbytes for i in b) for b in torch_indices]
    result["param_bytes"] = [p.nbytes for p in params]
    accumulated = no_sync_run(world_group, micro_batches=2)
    result["no_sync"] = {
        "collectives_per_micro_batch": accumulated["collectives_per_micro_batch"],
        "diff_single": max_diff(accumulated["grads"], single_grads),
        "diff_one_batch": max_diff(accumulated["grads"], runs["dp4"]["first_grads"]),
    }
    result["bad_input"] = bad_input(world_group, layout.tp_group)
    return result


def all_reduces(step: list[dict], group: list[int]) -> list[dict]:
    return [e for e in step if e["op"] == "all_reduce" and e["group"] == group]


@on_ranks(4)
@pytest.mark.parametrize("run", ["dp4", "dp2", "tp2dp2", "tp2dp2/sp", "dp4/no_overlap", "dp4/one_bucket"])
def test_training_equals_single_process_on_the_global_batch(ranks, run):
    result = results()
    assert result["diff"][f"{run}/single_grads"] <= FP32, (run, result["rank"])
    assert result["diff"][f"{run}/single"] <= FP32, (run, result["rank"])
    assert result["loss_diff"][run] <= 1e-6


@on_ranks(4)
@pytest.mark.parametrize("dp", ["dp2", "dp4"])
def test_gradients_and_parameters_equal_torch_ddp(ranks, dp):
    result = results()
    assert result["diff"][f"{dp}/torch_grads"] <= FP32 and result["diff"][f"{dp}/torch"] <= FP32
    # two ranks sum in one order whatever the bucket boundaries: bitwise equal
    assert result["diff"]["dp2/torch"] == result["diff"]["dp2/torch_grads"] == 0.0


@on_ranks(4)
def test_bucket_layout_is_one_all_reduce_per_bucket_of_the_computed_size(ranks):
    result = results()
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


@on_ranks(4)
def test_bucket_layout_equals_torch_ddp_after_its_rebuild_in_gradient_order(ranks):
    """torch's Reducer starts from a forward-order assignment and rebuilds its buckets from the order the
    gradients arrived in during step 1; from step 2 on its all-reduces are ours, byte for byte."""
    result = results()
    for run, group in [("torch_dp4", [0, 1, 2, 3]), ("torch_dp2", [0, 1] if result["rank"] < 2 else [2, 3])]:
        for step in result["steps"][run][1:]:
            assert [e["nbytes"] for e in all_reduces(step, group)] == DP_BUCKETS


@on_ranks(4)
def test_overlap_issues_every_bucket_but_the_last_during_backward_before_the_last_gradient(ranks):
    result = results()
    for step in result["steps"]["dp4"]:
        assert [(e["phase"], e["before_last_gradient"]) for e in step] == (
            [("backward", True)] * (len(DP_BUCKETS) - 1) + [("backward", False)]
        )
    for step in result["steps"]["dp4/no_overlap"]:  # all issued by finish_grad_sync, after backward
        assert [(e["phase"], e["before_last_gradient"]) for e in step] == [("forward", False)] * len(DP_BUCKETS)


@on_ranks(4)
def test_tp_x_dp_reduces_shards_on_the_dp_group_and_keeps_the_tp_collectives(ranks):
    result = results()
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


@on_ranks(4)
def test_no_sync_accumulates_without_collectives_then_one_sync_equals_one_big_batch(ranks):
    result = results()
    no_sync = result["no_sync"]
    assert no_sync["collectives_per_micro_batch"] == [0, len(DP_BUCKETS)]
    assert no_sync["diff_single"] <= FP32 and no_sync["diff_one_batch"] <= FP32


@on_ranks(4)
def test_bad_input_gets_one_line_errors(ranks):
    errors = results()["bad_input"]
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

"""FSDP x TP (reference.data_parallel.fsdp_tp) on 4 ranks = TP 2 x DP 2, CPU/gloo.

The first test to ask (`results()`, once a rank) trains the 2-layer test transformer (hidden 12, 2 heads) for three SGD
steps as reference FSDP over the DP group of TP-sharded blocks, with and without sequence parallelism, next to
single-process training and PyTorch's FSDP2 (`fully_shard` on the "dp" mesh dimension) over DTensor TP
(`parallelize_module`) on a 2D DeviceMesh whose groups are the layout's.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from reference.data_parallel import finalize_model_grads, local_batch
from reference.data_parallel.fsdp_tp import shard_tp_model
from reference.gpt.model import gpt_blocks
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import ParallelConfigError, build_layout
from reference.tensor_parallel.parallelize import parallelize
from tests.ranks import on_ranks
from tests.reference import regression
from tests.reference.helpers import dtensor_plan, every_rank, full_tensor, max_diff

# hidden 12: qkv's bias shard (18 floats) is not a multiple of 16 bytes, so the flat layout has alignment padding
H, HEADS, LAYERS, S, B, STEPS, SEED, LR = 12, 2, 2, 8, 4, 3, 1234, 0.1
DEVICE = torch.device("cpu")


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return regression.batches(STEPS, S, B, H)


def events(rec: CollectiveRecorder) -> list[dict]:
    return [{"op": e.op, "group": list(e.group_ranks), "nbytes": e.nbytes, "phase": e.phase} for e in rec.events]


def train(model, step_fn, layout) -> tuple[list[float], list[list[dict]]]:
    """STEPS SGD steps; `step_fn(x, target)` runs forward + backward (+ gradient finishing) on the local batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, records = [], []
    for x, target in batches():
        with CollectiveRecorder() as rec:
            loss = step_fn(local_batch(x, layout.dp_group, dim=1), local_batch(target, layout.dp_group, dim=1))
        records.append(events(rec))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(regression.mean_over(loss.item(), layout.dp_group))
    return losses, records


def run_reference(layout, sp: bool) -> dict:
    torch.manual_seed(SEED)
    model = shard_tp_model(
        parallelize(gpt_blocks(LAYERS, H, HEADS, device=DEVICE), layout, sequence_parallel=sp), layout
    )

    def step(x, target):
        loss = regression.mse(model(None, None, hidden=x), target)
        loss.backward()
        # under SP: the TP sum of the partial LayerNorm / row-bias gradients, on FSDP's sharded gradients
        finalize_model_grads([model], layout.tp_group)
        return loss

    losses, records = train(model, step, layout)
    params = {
        n: full_tensor(n.rsplit(".", 1)[0], n.rsplit(".", 1)[1], t, layout.tp_group)
        for n, t in model.full_parameters().items()
    }
    units = [
        {
            "name": h.name,
            "numel": h.numel,
            "padded_numel": h.padded_numel,
            "shard_numel": h.shard_numel,
            "param_numel": h.param_numel,
        }
        for h in model.handles()
    ]
    return {"losses": losses, "steps": records, "params": params, "units": units}


def run_fsdp2(mesh, layout, sp: bool) -> dict:
    torch.manual_seed(SEED)
    model = gpt_blocks(LAYERS, H, HEADS, device=DEVICE)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], dtensor_plan(sp))
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    def step(x, target):
        if sp:  # enter and leave the sequence-parallel region the DTensor way (split / all-gather)
            local = DTensor.from_local(x, mesh["tp"], [Replicate()]).redistribute(mesh["tp"], [Shard(0)]).to_local()
            out = DTensor.from_local(model(None, None, hidden=local), mesh["tp"], [Shard(0)]).full_tensor()
        else:
            out = model(None, None, hidden=x)
        loss = regression.mse(out, target)
        loss.backward()
        return loss

    losses, records = train(model, step, layout)
    return {
        "losses": losses,
        "steps": records,
        "params": {n: p.full_tensor().detach() for n, p in model.named_parameters()},
    }


def tp_only_step(layout, sp: bool) -> list[dict]:
    """One forward + backward of the TP-only model on the same local batch: its TP collectives."""
    torch.manual_seed(SEED)
    model = parallelize(gpt_blocks(LAYERS, H, HEADS, device=DEVICE), layout, sequence_parallel=sp)
    x, target = batches()[0]
    with CollectiveRecorder() as rec:
        out = model(None, None, hidden=local_batch(x, layout.dp_group, dim=1))
        regression.mse(out, local_batch(target, layout.dp_group, dim=1)).backward()
    return events(rec)


def bad_input(layout) -> dict[str, str]:
    errors = {}

    def capture(key, build):
        try:
            shard_tp_model(build(), layout)
        except ParallelConfigError as error:
            errors[key] = str(error)

    def full_weight():
        model = parallelize(gpt_blocks(1, H, HEADS, device=DEVICE), layout)
        model.layers[0].attention.qkv.weight = torch.nn.Parameter(torch.zeros(3 * H, H))
        return model

    def uneven_plain_parameter():  # not TP-aware, and shaped differently on the two TP ranks
        model = parallelize(gpt_blocks(1, H, HEADS, device=DEVICE), layout)
        model.layers[0].register_parameter("extra", torch.nn.Parameter(torch.zeros(3 + 2 * layout.tp_rank)))
        return model

    capture("unsharded_model", lambda: gpt_blocks(1, H, HEADS, device=DEVICE))
    capture("full_weight", full_weight)
    capture("uneven_plain_parameter", uneven_plain_parameter)
    return errors


FP32 = 1e-7  # observed <= 3.8e-9 against both oracles
# One block's TP-local parameters (fp32 elements): ln1 12+12, qkv 18x12+18, proj 12x6+12, ln2 12+12,
# fc1 24x12+24, fc2 12x24+12 = 978; qkv.bias ends off a 16-byte boundary, so the flat buffer is 980 (FSDP1's
# alignment), which dp=2 divides: each rank keeps 490 elements.
UNIT_PARAM_NUMEL, UNIT_NUMEL = 978, 980
DP = 2


@functools.cache
def results() -> dict:
    """This rank's view of both configurations (plain, sp) against their oracles, and the bad-input errors
    (TP 2 x DP 2; computed once a rank: the tests read it)."""
    rank = dist.get_rank()
    layout = build_layout(tp_size=2)  # TP [0,1] [2,3], DP [0,2] [1,3]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # the same groups
    assert dist.get_process_group_ranks(mesh["tp"].get_group()) == dist.get_process_group_ranks(layout.tp_group)
    assert dist.get_process_group_ranks(mesh["dp"].get_group()) == dist.get_process_group_ranks(layout.dp_group)
    single_losses, _, single_params = regression.single_process(LAYERS, H, HEADS, SEED, LR, batches())
    result = {
        "rank": rank,
        "dp_group": dist.get_process_group_ranks(layout.dp_group),
        "tp_group": dist.get_process_group_ranks(layout.tp_group),
        "diff": {},
        "loss_diff": {},
    }
    for sp in (False, True):
        name = "sp" if sp else "plain"
        ours, theirs = run_reference(layout, sp), run_fsdp2(mesh, layout, sp)
        result["diff"][f"{name}/single"] = max_diff(ours["params"], single_params)
        result["diff"][f"{name}/fsdp2"] = max_diff(ours["params"], theirs["params"])
        result["diff"][f"fsdp2_{name}/single"] = max_diff(theirs["params"], single_params)
        result["loss_diff"][f"{name}/single"] = max(abs(a - b) for a, b in zip(ours["losses"], single_losses))
        result["loss_diff"][f"{name}/fsdp2"] = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"]))
        result[name] = {
            "steps": ours["steps"],
            "units": ours["units"],
            "fsdp2_steps": theirs["steps"],
            "tp_only": tp_only_step(layout, sp),
        }
    result["bad_input"] = bad_input(layout)
    return result


def on(events: list[dict], group: list[int]) -> list[tuple]:
    return [(e["op"], e["phase"], e["nbytes"]) for e in events if e["group"] == group]


@on_ranks(4)
@pytest.mark.parametrize("config", ["plain", "sp"])
def test_training_equals_single_process(ranks, config):
    result = results()
    assert result["diff"][f"{config}/single"] <= FP32, result["rank"]
    assert result["loss_diff"][f"{config}/single"] <= 1e-6


@on_ranks(4)
@pytest.mark.parametrize("config", ["plain", "sp"])
def test_matches_fsdp2_over_dtensor_tp_on_a_2d_mesh(ranks, config):
    result = results()
    assert result["diff"][f"fsdp2_{config}/single"] <= FP32  # the oracle itself trains correctly
    assert result["diff"][f"{config}/fsdp2"] <= FP32, result["rank"]
    assert result["loss_diff"][f"{config}/fsdp2"] == 0.0  # observed: the same losses, bit for bit


@on_ranks(4)
@pytest.mark.parametrize("config", ["plain", "sp"])
def test_dp_group_carries_fsdp_all_gathers_and_reduce_scatters_of_the_tp_sharded_unit(ranks, config):
    unit_bytes = UNIT_NUMEL * 4  # recorded as the full gathered / unreduced buffer; each rank sends 1/dp of it
    result = results()
    assert [(u["param_numel"], u["numel"], u["padded_numel"], u["shard_numel"]) for u in result[config]["units"]] == [
        (UNIT_PARAM_NUMEL, UNIT_NUMEL, UNIT_NUMEL, UNIT_NUMEL // DP)
    ] * 2
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


@on_ranks(4)
@pytest.mark.parametrize("config", ["plain", "sp"])
def test_tp_group_carries_the_tp_only_models_collectives(ranks, config):
    result = results()
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


@on_ranks(4)
def test_sequence_parallel_grads_are_summed_over_tp_on_the_sharded_gradients(ranks):
    """After FSDP's reduce-scatter each rank holds 1/dp of the flat gradient: the TP all-reduce of the
    LayerNorm and row-bias gradients sends only their part of this rank's shard. Block layout: ln1, proj.bias,
    ln2 (5 x 12 floats) lie in the first half (DP rank 0), fc2.bias (12) in the second (DP rank 1)."""
    result, mine = results(), set()
    for step in result["sp"]["steps"]:
        last = step[-1]
        assert (last["op"], last["group"], last["phase"]) == ("all_reduce", result["tp_group"], "forward")
        mine.add(last["nbytes"])
    assert len(mine) == 1, "the same bytes every step"
    everyone = every_rank(mine.pop())
    sent = dict(enumerate(everyone))
    assert sent == {0: 2 * 5 * 12 * 4, 1: 2 * 5 * 12 * 4, 2: 2 * 1 * 12 * 4, 3: 2 * 1 * 12 * 4}
    assert sent[0] + sent[2] == 2 * 6 * 12 * 4  # over the DP group: every SP gradient once


@on_ranks(4)
def test_bad_input_gets_one_line_errors_on_every_rank(ranks):
    result = results()
    assert result["bad_input"] == {
        "unsharded_model": "shard_tp_model: rank 0: GPT has no tensor-parallel block to wrap; "
        "split it first with reference.tensor_parallel.parallelize.parallelize(model, layout)",
        "full_weight": "shard_tp_model: rank 0: layers.0.attention.qkv.weight has shape [36, 12], expected "
        "[18, 12]: a TP-sharded layer must hold this rank's 1/2 slice, not the full weight",
        "uneven_plain_parameter": "shard_tp_model: parameter shapes differ between ranks 0 and 1 of TP group "
        "[0, 1] (first: 'layers.0.extra' [5]); FSDP x TP needs one flat layout per "
        "TP and per DP group",
    }

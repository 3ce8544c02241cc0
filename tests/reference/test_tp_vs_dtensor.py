"""The TP transformer against PyTorch DTensor TP (ColwiseParallel / RowwiseParallel / SequenceParallel)
applied to the plain transformer, at world 2: equal numbers (asserted on every rank, naming the tensor), and
collective counts that agree with CommDebugMode."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from reference.gpt.model import gpt_blocks
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads
from reference.tensor_parallel.parallelize import parallelize
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES
from tests.reference.helpers import assert_close, dtensor_plan, full_tensor

H, HEADS, LAYERS, S, B = 16, 4, 2, 8, 2


def comm_debug_counts(mode: CommDebugMode) -> dict:
    names = {
        "all_reduce": "all_reduce",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "allreduce_": "all_reduce",
        "_allgather_base_": "all_gather",
        "_reduce_scatter_base_": "reduce_scatter",
    }
    return {names[str(op).split(".")[-1]]: n for op, n in mode.get_comm_counts().items() if n}


def counts(rec: CollectiveRecorder, phase: str) -> dict:
    return {op: v["count"] for op, v in rec.summary(phase).items()}


def run_dtensor(mesh, sp: bool, x: torch.Tensor):
    torch.manual_seed(1234)
    model = gpt_blocks(LAYERS, H, HEADS, device=x.device)
    for block in model.layers:
        parallelize_module(block, mesh, dtensor_plan(sp))
    x = x.clone().requires_grad_()
    with CollectiveRecorder() as rec, CommDebugMode() as comm:
        if sp:  # enter and leave the sequence-parallel region the DTensor way (split / all-gather)
            local = DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [Shard(0)]).to_local()
            out = DTensor.from_local(model(None, None, hidden=local), mesh, [Shard(0)]).full_tensor()
        else:
            out = model(None, None, hidden=x)
        forward_comm = comm_debug_counts(comm)
        (out * out).sum().backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    return out, x.grad, grads, rec, {"forward": forward_comm, "all": comm_debug_counts(comm)}


def run_reference(layout, sp: bool, x: torch.Tensor):
    torch.manual_seed(1234)
    model = parallelize(gpt_blocks(LAYERS, H, HEADS, device=x.device), layout, sequence_parallel=sp)
    x = x.clone().requires_grad_()
    with CollectiveRecorder() as rec, CommDebugMode() as comm:
        out = model(None, None, hidden=x)
        (out * out).sum().backward()
    allreduce_sequence_parallel_grads(model, layout.tp_group)
    grads = {
        n: full_tensor(n.rsplit(".", 1)[0], n.rsplit(".", 1)[1], p.grad, layout.tp_group)
        for n, p in model.named_parameters()
    }
    return out, x.grad, grads, rec, {"all": comm_debug_counts(comm)}


@functools.cache
def runs(device: torch.device) -> dict:
    """Per configuration (tp, sp): both sides' recorded counts and CommDebugMode's, computed once a rank (the
    numbers asserted on the way)."""
    world = dist.get_world_size()
    layout = build_layout(tp_size=world)
    mesh = init_device_mesh(device.type, (world,))
    found = {}
    for sp in (False, True):
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(3)).to(device)
        ours, theirs = run_reference(layout, sp, x), run_dtensor(mesh, sp, x)
        assert_close(ours[0], theirs[0], f"sp={sp} output")
        assert_close(ours[1], theirs[1], f"sp={sp} input grad")
        for name in theirs[2]:
            assert_close(ours[2][name], theirs[2][name], f"sp={sp} grad {name}")
        found["sp" if sp else "tp"] = {
            "reference": {p: counts(ours[3], p) for p in ("forward", "backward")},
            "dtensor": {p: counts(theirs[3], p) for p in ("forward", "backward")},
            "reference_all": {op: v["count"] for op, v in ours[3].summary().items()},
            "dtensor_all": {op: v["count"] for op, v in theirs[3].summary().items()},
            "comm_debug": {"reference": ours[4], "dtensor": theirs[4]},
            "grads_compared": sorted(theirs[2]),
        }
    return found


@on_ranks(2, devices=DEVICES)
@pytest.mark.parametrize("config", ["tp", "sp"])
def test_recorder_counts_equal_comm_debug_mode(ranks, config):
    run = runs(ranks.device)[config]
    assert run["reference_all"] == run["comm_debug"]["reference"]["all"]
    assert run["dtensor_all"] == run["comm_debug"]["dtensor"]["all"]
    assert run["dtensor"]["forward"] == run["comm_debug"]["dtensor"]["forward"]
    assert len(run["grads_compared"]) == 2 * 12  # 2 layers of 12 parameters, each equal to DTensor's


@on_ranks(2, devices=DEVICES)
def test_tp_transformer_matches_dtensor_tp(ranks):
    counts = runs(ranks.device)
    # 2 layers: without SP both issue 2 all-reduces per block each way
    assert (
        counts["tp"]["reference"]
        == counts["tp"]["dtensor"]
        == {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}
    )
    # with SP the forward is identical (an all-gather + reduce-scatter per column/row pair, plus the exit
    # gather); in backward the reference re-gathers each column layer's input (Megatron's memory saving)
    # where DTensor keeps the gathered activation: one more all-gather per column layer, 2 per block
    assert (
        counts["sp"]["reference"]["forward"]
        == counts["sp"]["dtensor"]["forward"]
        == {"all_gather": 5, "reduce_scatter": 4}
    )
    assert counts["sp"]["dtensor"]["backward"] == {"all_gather": 5, "reduce_scatter": 4}
    assert counts["sp"]["reference"]["backward"] == {"all_gather": 5 + 4, "reduce_scatter": 4}

"""The collective recorder (reference.measure.recorder) on real collectives (gloo; NCCL on CUDA), eager c10d,
functional (DTensor-style), FSDP1 and FSDP2, at world size 2 (TP groups at 4 and 64 ranks are covered by the TP
tests). Each body runs on both ranks and compares what it recorded there with what it should have recorded."""

import json
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils.flop_counter import FlopCounterMode

from reference.distributed import all_gather_single, reduce_scatter_single
from reference.measure.recorder import CollectiveRecorder
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES

WORLD = 2
EVERYONE = tuple(range(WORLD))  # group ranks and shapes are recorded as tuples


class AllReduceGradInBackward(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient in backward (the shape of Megatron's copy-to region)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(AllReduceGradInBackward.apply(x))
        dist.all_reduce(y.detach().clone())
        return y


def two_units() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@on_ranks(1, WORLD, devices=DEVICES)
def test_collectives_still_work_after_the_recorder_exits(ranks):
    with ranks.device, CollectiveRecorder():
        pass
    with ranks.device:
        dist.all_reduce(torch.ones(1), async_op=True).wait()
        total = torch.ones(1)
        dist.all_reduce(total)
    assert total.item() == float(ranks.world)


@on_ranks(1, WORLD, devices=DEVICES)  # world 1: the one-GPU form
def test_eager_ops_are_recorded_with_group_shape_bytes_dtype_phase(ranks):
    world, everyone = ranks.world, tuple(range(ranks.world))
    full = 4 * world * 3 * 4
    with ranks.device, CollectiveRecorder() as rec:
        x = torch.arange(12, dtype=torch.float32).view(4, 3)
        dist.all_reduce(x.clone())
        out = torch.empty(4 * world, 3)
        dist.all_gather_into_tensor(out, x)
        all_gather_single(out, x)  # dist.all_gather_single where torch has it (2.13 on)
        shard = torch.empty(4 // world, 3)
        dist.reduce_scatter_tensor(shard, x)
        reduce_scatter_single(shard, x)
        dist.all_gather([torch.empty(4, 3) for _ in range(world)], x)
        dist.broadcast(x.clone(), 0)
        dist.all_reduce(x.to(torch.bfloat16))
    assert [[e.op, e.group_ranks, e.shape, e.nbytes, e.dtype, e.phase, e.async_op] for e in rec.events] == [
        ["all_reduce", everyone, (4, 3), 48, "float32", "forward", False],
        ["all_gather", everyone, (4 * world, 3), full, "float32", "forward", False],
        ["all_gather", everyone, (4 * world, 3), full, "float32", "forward", False],
        ["reduce_scatter", everyone, (4, 3), 48, "float32", "forward", False],
        ["reduce_scatter", everyone, (4, 3), 48, "float32", "forward", False],
        ["all_gather", everyone, (4 * world, 3), full, "float32", "forward", False],
        ["broadcast", everyone, (4, 3), 48, "float32", "forward", False],
        ["all_reduce", everyone, (4, 3), 24, "bfloat16", "forward", False],
    ]
    assert all(e.end is not None and e.end >= e.start for e in rec.events)
    assert rec.summary() == {
        "all_reduce": {"count": 2, "bytes": 72},
        "all_gather": {"count": 3, "bytes": 3 * full},
        "reduce_scatter": {"count": 2, "bytes": 96},
        "broadcast": {"count": 1, "bytes": 48},
    }


@on_ranks(WORLD, devices=DEVICES)
def test_an_async_collective_ends_when_it_is_waited_on(ranks):
    with ranks.device, CollectiveRecorder() as rec:
        work = dist.all_reduce(torch.ones(8), async_op=True)
        time.sleep(0.2)
        work.wait()
        after_wait = time.perf_counter()
    (event,) = rec.events
    assert event.async_op
    assert 0.2 <= event.end - event.start and event.end <= after_wait, (event, after_wait)


@on_ranks(WORLD, devices=DEVICES)
def test_a_subgroup_collective_records_the_subgroup_ranks(ranks):
    """Only the last rank is in the group it all-reduces on."""
    last_rank = WORLD - 1
    last = dist.new_group([last_rank])
    with ranks.device, CollectiveRecorder() as rec:
        if ranks.rank == last_rank:
            dist.all_reduce(torch.ones(2), group=last)
    assert [e.group_ranks for e in rec.events] == ([(last_rank,)] if ranks.rank == last_rank else [])


@on_ranks(WORLD, devices=DEVICES)
def test_point_to_point_is_recorded_on_both_ends(ranks):
    """Rank 0 sends five fp32 numbers to rank 1."""
    with ranks.device, CollectiveRecorder() as rec:
        if ranks.rank == 0:
            dist.send(torch.ones(5), dst=1)
        else:
            dist.recv(torch.empty(5), src=0)
    assert [[e.op, e.nbytes] for e in rec.events] == [["send" if ranks.rank == 0 else "recv", 20]]


@on_ranks(WORLD, devices=DEVICES)
def test_functional_collectives_are_recorded_and_still_compute(ranks):
    """All-reduce, all-gather and reduce-scatter of a [4, 2] tensor of ones."""
    with ranks.device, CollectiveRecorder() as rec:
        x = torch.ones(4, 2)
        a = funcol.all_reduce(x, "sum", dist.group.WORLD) * 1
        g = funcol.all_gather_tensor(x, 0, dist.group.WORLD) * 1
        r = funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD) * 1
    assert a.tolist() == [[float(WORLD)] * 2] * 4 and list(g.shape) == [4 * WORLD, 2]
    assert r.tolist() == [[WORLD * 1.0] * 2] * (4 // WORLD)
    assert [[e.op, e.group_ranks, e.shape, e.nbytes] for e in rec.events] == [
        ["all_reduce", EVERYONE, (4, 2), 32],
        ["all_gather", EVERYONE, (4 * WORLD, 2), 32 * WORLD],
        ["reduce_scatter", EVERYONE, (4, 2), 32],
    ]


@on_ranks(WORLD, devices=DEVICES)
def test_fsdp2_collectives_are_attributed_to_their_unit_at_the_full_flat_size(ranks):
    """PyTorch FSDP2 (fully_shard) on two Linear units: all-gathers and reduce-scatters of the full flat size."""
    from torch.distributed.fsdp import fully_shard

    full = {"net.0": (8 * 16 + 16) * 4, "net.2": (16 * 4 + 4) * 4}  # fp32 bytes of each unit's parameters
    with ranks.device:
        model = two_units()
        for unit in (model[0], model[2]):
            fully_shard(unit)
        with CollectiveRecorder() as rec:
            handles = rec.watch(model, prefix="net")
            model(torch.randn(2, 8)).sum().backward()
    for h in handles:
        h.remove()
    forward = [[e.op, e.module, e.nbytes] for e in rec.events if e.phase == "forward"]
    assert forward == [["all_gather", "net.0", full["net.0"]], ["all_gather", "net.2", full["net.2"]]]
    backward = sorted(e.nbytes for e in rec.events if e.op == "reduce_scatter" and e.phase == "backward")
    assert backward == sorted(full.values())


@on_ranks(WORLD, devices=DEVICES)
def test_fsdp1_reduce_scatter_is_attributed_to_the_unit_owning_the_flat_parameter(ranks):
    """PyTorch FSDP1: the reduce-scatter issued from a hook on a flat parameter's AccumulateGrad node is
    attributed to the FSDP unit owning that parameter."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with ranks.device:
        model = two_units()
        model[0], model[2] = FSDP(model[0], device_id=ranks.device), FSDP(model[2], device_id=ranks.device)
        root = FSDP(model, device_id=ranks.device)
        with CollectiveRecorder() as rec:
            handles = rec.watch(root, prefix="net")
            root(torch.randn(2, 8)).sum().backward()
    for h in handles:
        h.remove()
    assert [[e.module, e.nbytes] for e in rec.events if e.op == "reduce_scatter"] == [
        ["net._fsdp_wrapped_module.2._fsdp_wrapped_module", (16 * 4 + 4) * 4],
        ["net._fsdp_wrapped_module.0._fsdp_wrapped_module", (8 * 16 + 16) * 4],
    ]


@on_ranks(WORLD, devices=DEVICES)
def test_phase_module_spans_json_and_explicit_scope(ranks):
    with ranks.device:
        model = torch.nn.Sequential(Inner())
        x = torch.ones(2, 4, requires_grad=True)
        with CollectiveRecorder() as rec:
            handles = rec.watch(model, prefix="net")
            with rec.span("forward"):
                loss = model(x).sum()
            with rec.scope("step"):  # an enclosing scope must not capture backward attribution
                loss.backward()
            for h in handles:
                h.remove()
        with CollectiveRecorder() as explicit, explicit.scope("explicit"):
            dist.all_reduce(torch.ones(1))
    assert [[e.op, e.phase, e.module] for e in rec.events] == [
        ["all_reduce", "forward", "net.0"],
        ["all_reduce", "backward", "net.0"],
    ]
    (span,) = rec.spans
    assert span.name == "forward" and span.phase == "forward" and span.end >= span.start
    data = json.loads(rec.to_json())
    assert data["rank"] == ranks.rank and len(data["events"]) == 2 and data["events"][0]["start"] >= 0
    assert data["summary"] == rec.summary()
    assert rec.summary(phase="backward") == {"all_reduce": {"count": 1, "bytes": 32}}
    assert explicit.events[0].module == "explicit"


@on_ranks(WORLD, devices=DEVICES)
def test_spans_and_collectives_are_stamped_with_the_flops_flop_counter_mode_counts(ranks):
    """The FLOPs a span ran are what FlopCounterMode counts (2 x 3 x 8 x 4 for a Linear(8, 4) on 3 rows); a
    collective carries the FLOPs counted before it, in the object and in its JSON."""
    with ranks.device:
        layer, x = torch.nn.Linear(8, 4), torch.randn(3, 8)
        with FlopCounterMode(display=False) as counter:
            layer(x)
        with CollectiveRecorder() as rec:
            dist.all_reduce(torch.ones(1))
            with rec.span("linear"):
                y = layer(x)
            dist.all_reduce(y)
    counted = counter.get_total_flops()
    assert counted == 2 * 3 * 8 * 4
    (span,) = rec.spans
    assert [span.flops_start, span.flops_end] == [0, counted] and [e.flops for e in rec.events] == [0, counted]
    data = rec.to_dict()
    assert data["spans"][0]["flops_end"] == data["events"][1]["flops"] == counted

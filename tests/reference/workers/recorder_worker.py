"""Per-rank checks of reference.recorder on real gloo collectives (launched by test_recorder.py)."""
import json
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils.flop_counter import FlopCounterMode

from common import finish, init
from reference.recorder import CollectiveRecorder

torch.set_default_device(init())
rank, world = dist.get_rank(), dist.get_world_size()
everyone = tuple(range(world))


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


def check_eager_ops():
    x = torch.arange(12, dtype=torch.float32).view(4, 3)
    with CollectiveRecorder() as rec:
        dist.all_reduce(x.clone())
        out = torch.empty(4 * world, 3)
        dist.all_gather_into_tensor(out, x)
        dist.all_gather_single(out, x)
        shard = torch.empty(4 // world, 3)
        dist.reduce_scatter_tensor(shard, x)
        dist.reduce_scatter_single(shard, x)
        dist.all_gather([torch.empty(4, 3) for _ in range(world)], x)
        dist.broadcast(x.clone(), 0)
        dist.all_reduce(x.to(torch.bfloat16))
    got = [(e.op, e.group_ranks, e.shape, e.nbytes, e.dtype, e.phase, e.async_op) for e in rec.events]
    full = 4 * world * 3 * 4
    assert got == [
        ("all_reduce", everyone, (4, 3), 48, "float32", "forward", False),
        ("all_gather", everyone, (4 * world, 3), full, "float32", "forward", False),
        ("all_gather", everyone, (4 * world, 3), full, "float32", "forward", False),
        ("reduce_scatter", everyone, (4, 3), 48, "float32", "forward", False),
        ("reduce_scatter", everyone, (4, 3), 48, "float32", "forward", False),
        ("all_gather", everyone, (4 * world, 3), full, "float32", "forward", False),
        ("broadcast", everyone, (4, 3), 48, "float32", "forward", False),
        ("all_reduce", everyone, (4, 3), 24, "bfloat16", "forward", False),
    ], got
    assert all(e.end is not None and e.end >= e.start for e in rec.events)
    assert rec.summary() == {"all_reduce": {"count": 2, "bytes": 72}, "all_gather": {"count": 3, "bytes": 3 * full},
                             "reduce_scatter": {"count": 2, "bytes": 96}, "broadcast": {"count": 1, "bytes": 48}}


def check_async_end_is_wait_time():
    with CollectiveRecorder() as rec:
        work = dist.all_reduce(torch.ones(8), async_op=True)
        time.sleep(0.2)
        work.wait()
        after_wait = time.perf_counter()
    (event,) = rec.events
    assert event.async_op
    assert 0.2 <= event.end - event.start and event.end <= after_wait, (event.start, event.end, after_wait)


def check_subgroup_ranks():
    last = dist.new_group([world - 1])
    with CollectiveRecorder() as rec:
        if rank == world - 1:
            dist.all_reduce(torch.ones(2), group=last)
    assert [e.group_ranks for e in rec.events] == ([(world - 1,)] if rank == world - 1 else [])


def check_point_to_point():
    with CollectiveRecorder() as rec:
        if rank == 0:
            dist.send(torch.ones(5), dst=1)
        elif rank == 1:
            dist.recv(torch.empty(5), src=0)
    expected = {0: [("send", 20)], 1: [("recv", 20)]}.get(rank, [])
    assert [(e.op, e.nbytes) for e in rec.events] == expected


def check_functional_collectives():
    x = torch.ones(4, 2)
    with CollectiveRecorder() as rec:
        a = funcol.all_reduce(x, "sum", dist.group.WORLD) * 1
        g = funcol.all_gather_tensor(x, 0, dist.group.WORLD) * 1
        r = funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD) * 1
    assert torch.equal(a, x * world) and g.shape == (4 * world, 2)
    assert torch.equal(r, torch.full((4 // world, 2), world * 1.0))
    got = [(e.op, e.group_ranks, e.shape, e.nbytes) for e in rec.events]
    assert got == [("all_reduce", everyone, (4, 2), 32), ("all_gather", everyone, (4 * world, 2), 32 * world),
                   ("reduce_scatter", everyone, (4, 2), 32)], got


def check_phase_module_and_spans():
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
    got = [(e.op, e.phase, e.module) for e in rec.events]
    assert got == [("all_reduce", "forward", "net.0"), ("all_reduce", "backward", "net.0")], got
    (span,) = rec.spans
    assert span.name == "forward" and span.phase == "forward" and span.end >= span.start
    data = json.loads(rec.to_json())
    assert data["rank"] == rank and len(data["events"]) == 2 and data["events"][0]["start"] >= 0
    assert data["summary"] == rec.summary()
    assert rec.summary(phase="backward") == {"all_reduce": {"count": 1, "bytes": 32}}
    with CollectiveRecorder() as rec2:
        with rec2.scope("explicit"):
            dist.all_reduce(torch.ones(1))
    assert rec2.events[0].module == "explicit"


def check_fsdp2_unit_attribution():
    """PyTorch FSDP2 (fully_shard) on two Linear units: all-gathers and reduce-scatters of the full flat size."""
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for unit in (model[0], model[2]):
        fully_shard(unit)
    with CollectiveRecorder() as rec:
        handles = rec.watch(model, prefix="net")
        model(torch.randn(2, 8)).sum().backward()
    for h in handles:
        h.remove()
    full = {"net.0": (8 * 16 + 16) * 4, "net.2": (16 * 4 + 4) * 4}  # fp32 bytes of each unit's parameters
    forward = [(e.op, e.module, e.nbytes) for e in rec.events if e.phase == "forward"]
    assert forward == [("all_gather", "net.0", full["net.0"]), ("all_gather", "net.2", full["net.2"])], forward
    reduce_scatters = sorted(e.nbytes for e in rec.events if e.op == "reduce_scatter" and e.phase == "backward")
    assert reduce_scatters == sorted(full.values()), reduce_scatters


def check_fsdp1_post_backward_attribution():
    """PyTorch FSDP1: the reduce-scatter issued from a hook on a flat parameter's AccumulateGrad node is
    attributed to the FSDP unit owning that parameter."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    device = torch.get_default_device()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model[0], model[2] = FSDP(model[0], device_id=device), FSDP(model[2], device_id=device)
    root = FSDP(model, device_id=device)
    with CollectiveRecorder() as rec:
        handles = rec.watch(root, prefix="net")
        root(torch.randn(2, 8)).sum().backward()
    for h in handles:
        h.remove()
    got = [(e.module, e.nbytes) for e in rec.events if e.op == "reduce_scatter"]
    assert got == [("net._fsdp_wrapped_module.2._fsdp_wrapped_module", (16 * 4 + 4) * 4),
                   ("net._fsdp_wrapped_module.0._fsdp_wrapped_module", (8 * 16 + 16) * 4)], got


def check_torch_distributed_intact_after_exit():
    with CollectiveRecorder():
        pass
    work = dist.all_reduce(torch.ones(1), async_op=True)
    work.wait()
    dist.all_reduce(torch.ones(1))


def check_flop_stamps():
    """The FLOPs a span ran are what FlopCounterMode counts; a collective is stamped with the FLOPs before it."""
    layer, x = torch.nn.Linear(8, 4), torch.randn(3, 8)
    with FlopCounterMode(display=False) as counter:
        layer(x)
    with CollectiveRecorder() as rec:
        dist.all_reduce(torch.ones(1))
        with rec.span("linear"):
            y = layer(x)
        dist.all_reduce(y)
    (span,) = rec.spans
    assert span.flops_start == 0 and span.flops_end == counter.get_total_flops() == 2 * 3 * 8 * 4, span
    assert [e.flops for e in rec.events] == [0, span.flops_end]
    data = rec.to_dict()
    assert data["spans"][0]["flops_end"] == 192 and data["events"][1]["flops"] == 192


for check in [check_torch_distributed_intact_after_exit, check_eager_ops, check_async_end_is_wait_time,
              check_subgroup_ranks, check_point_to_point, check_functional_collectives, check_fsdp2_unit_attribution,
              check_fsdp1_post_backward_attribution, check_phase_module_and_spans, check_flop_stamps]:
    check()
    print(f"rank {rank}: {check.__name__} ok", flush=True)
finish()

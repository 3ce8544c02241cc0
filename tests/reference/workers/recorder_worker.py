"""reference.measure.recorder on real collectives (gloo; NCCL on CUDA): what each check recorded, per rank, written
for test_recorder.py to compare with what it should have recorded."""

import json
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from common import serve
from torch.utils.flop_counter import FlopCounterMode

from reference.distributed import all_gather_single, reduce_scatter_single
from reference.measure.recorder import CollectiveRecorder


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


def check_eager_ops() -> dict:
    world = dist.get_world_size()
    x = torch.arange(12, dtype=torch.float32).view(4, 3)
    with CollectiveRecorder() as rec:
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
    return {
        "events": [[e.op, e.group_ranks, e.shape, e.nbytes, e.dtype, e.phase, e.async_op] for e in rec.events],
        "ended_after_start": all(e.end is not None and e.end >= e.start for e in rec.events),
        "summary": rec.summary(),
    }


def check_async_end_is_wait_time() -> dict:
    with CollectiveRecorder() as rec:
        work = dist.all_reduce(torch.ones(8), async_op=True)
        time.sleep(0.2)
        work.wait()
        after_wait = time.perf_counter()
    return {
        "events": [{"async_op": e.async_op, "start": e.start, "end": e.end} for e in rec.events],
        "after_wait": after_wait,
    }


def check_subgroup_ranks() -> list:
    """Only the last rank is in the group it all-reduces on."""
    last_rank = dist.get_world_size() - 1
    last = dist.new_group([last_rank])
    with CollectiveRecorder() as rec:
        if dist.get_rank() == last_rank:
            dist.all_reduce(torch.ones(2), group=last)
    return [e.group_ranks for e in rec.events]


def check_point_to_point() -> list:
    """Rank 0 sends five fp32 numbers to rank 1."""
    with CollectiveRecorder() as rec:
        if dist.get_rank() == 0:
            dist.send(torch.ones(5), dst=1)
        elif dist.get_rank() == 1:
            dist.recv(torch.empty(5), src=0)
    return [[e.op, e.nbytes] for e in rec.events]


def check_functional_collectives() -> dict:
    """All-reduce, all-gather and reduce-scatter of a [4, 2] tensor of ones."""
    x = torch.ones(4, 2)
    with CollectiveRecorder() as rec:
        a = funcol.all_reduce(x, "sum", dist.group.WORLD) * 1
        g = funcol.all_gather_tensor(x, 0, dist.group.WORLD) * 1
        r = funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD) * 1
    return {
        "all_reduce": a.tolist(),
        "all_gather_shape": list(g.shape),
        "reduce_scatter": r.tolist(),
        "events": [[e.op, e.group_ranks, e.shape, e.nbytes] for e in rec.events],
    }


def check_phase_module_and_spans() -> dict:
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
    data = json.loads(rec.to_json())
    with CollectiveRecorder() as rec2:
        with rec2.scope("explicit"):
            dist.all_reduce(torch.ones(1))
    return {
        "events": [[e.op, e.phase, e.module] for e in rec.events],
        "spans": [{"name": s.name, "phase": s.phase, "start": s.start, "end": s.end} for s in rec.spans],
        "to_json": data,
        "summary": rec.summary(),
        "backward_summary": rec.summary(phase="backward"),
        "scoped_module": rec2.events[0].module,
    }


def check_fsdp2_unit_attribution() -> dict:
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
    return {
        "forward": [[e.op, e.module, e.nbytes] for e in rec.events if e.phase == "forward"],
        "backward_reduce_scatters": sorted(
            e.nbytes for e in rec.events if e.op == "reduce_scatter" and e.phase == "backward"
        ),
    }


def check_fsdp1_post_backward_attribution() -> list:
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
    return [[e.module, e.nbytes] for e in rec.events if e.op == "reduce_scatter"]


def check_torch_distributed_intact_after_exit() -> float:
    """Collectives still work, and return their results, after a recorder has exited."""
    with CollectiveRecorder():
        pass
    work = dist.all_reduce(torch.ones(1), async_op=True)
    work.wait()
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def check_flop_stamps() -> dict:
    """The FLOPs a span ran, as FlopCounterMode counts them, and the FLOPs stamped on collectives."""
    layer, x = torch.nn.Linear(8, 4), torch.randn(3, 8)
    with FlopCounterMode(display=False) as counter:
        layer(x)
    with CollectiveRecorder() as rec:
        dist.all_reduce(torch.ones(1))
        with rec.span("linear"):
            y = layer(x)
        dist.all_reduce(y)
    (span,) = rec.spans
    data = rec.to_dict()
    return {
        "counted": counter.get_total_flops(),
        "span": [span.flops_start, span.flops_end],
        "events": [e.flops for e in rec.events],
        "json_span_end": data["spans"][0]["flops_end"],
        "json_event": data["events"][1]["flops"],
    }


CHECKS = [
    check_torch_distributed_intact_after_exit,
    check_eager_ops,
    check_async_end_is_wait_time,
    check_subgroup_ranks,
    check_point_to_point,
    check_functional_collectives,
    check_fsdp2_unit_attribution,
    check_fsdp1_post_backward_attribution,
    check_phase_module_and_spans,
    check_flop_stamps,
]


def results(device: torch.device) -> dict:
    """What each check recorded on this rank."""
    with device:  # the checks allocate on the default device
        return {
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            **{check.__name__.removeprefix("check_"): check() for check in CHECKS},
        }


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()

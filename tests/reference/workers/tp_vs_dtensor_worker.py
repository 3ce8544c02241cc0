"""The TP transformer against PyTorch DTensor TP applied to the plain transformer: numbers and collectives.

Every rank asserts the numerics (assert_close, naming the tensor) and writes, per configuration, both
implementations' recorded collective counts and CommDebugMode's, for test_tp_vs_dtensor.py to compare.
"""

import torch
import torch.distributed as dist
from common import assert_close, dtensor_plan, full_tensor, serve
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads
from reference.tensor_parallel.parallelize import parallelize
from reference.tensor_parallel.transformer import Transformer

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
    model = Transformer(LAYERS, H, HEADS, device=x.device)
    for block in model.layers:
        parallelize_module(block, mesh, dtensor_plan(sp))
    x = x.clone().requires_grad_()
    with CollectiveRecorder() as rec, CommDebugMode() as comm:
        if sp:  # enter and leave the sequence-parallel region the DTensor way (split / all-gather)
            local = DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [Shard(0)]).to_local()
            out = DTensor.from_local(model(local), mesh, [Shard(0)]).full_tensor()
        else:
            out = model(x)
        forward_comm = comm_debug_counts(comm)
        (out * out).sum().backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    return out, x.grad, grads, rec, {"forward": forward_comm, "all": comm_debug_counts(comm)}


def run_reference(layout, sp: bool, x: torch.Tensor):
    torch.manual_seed(1234)
    model = parallelize(Transformer(LAYERS, H, HEADS, device=x.device), layout, sequence_parallel=sp)
    x = x.clone().requires_grad_()
    with CollectiveRecorder() as rec, CommDebugMode() as comm:
        out = model(x)
        (out * out).sum().backward()
    allreduce_sequence_parallel_grads(model, layout.tp_group)
    grads = {
        n: full_tensor(n.rsplit(".", 1)[0], n.rsplit(".", 1)[1], p.grad, layout.tp_group)
        for n, p in model.named_parameters()
    }
    return out, x.grad, grads, rec, {"all": comm_debug_counts(comm)}


def results(device: torch.device) -> dict:
    """Per configuration (tp, sp): both sides' recorded counts and CommDebugMode's (numbers asserted here)."""
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


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()

"""Worker for test_fsdp_tp.py: `torchrun --nproc-per-node 4 fsdp_tp_worker.py OUTDIR` (TP 2 x DP 2).

Trains the test transformer for a few SGD steps as reference FSDP x TP (shard_tp_model), with and without
sequence parallelism, next to its oracles: the single-process model on the whole batch, and PyTorch's own
composition (FSDP2 `fully_shard` on the "dp" dimension of a 2D DeviceMesh over DTensor TP from
`parallelize_module`) built from the same unsharded model. Also records one step of the TP-only model on the
local batch (its TP collectives) and the bad-input errors. Each rank writes OUTDIR/rank{r}.json.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from common import dtensor_plan, full_tensor, max_diff, serve
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from reference.data_parallel import finalize_model_grads, local_batch
from reference.data_parallel.fsdp_tp import shard_tp_model
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import ParallelConfigError, build_layout
from reference.tensor_parallel.parallelize import parallelize
from reference.tensor_parallel.transformer import Transformer
from tests.reference import regression

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
        parallelize(Transformer(LAYERS, H, HEADS, device=DEVICE), layout, sequence_parallel=sp), layout
    )

    def step(x, target):
        loss = regression.mse(model(x), target)
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
    model = Transformer(LAYERS, H, HEADS, device=DEVICE)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], dtensor_plan(sp))
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    def step(x, target):
        if sp:  # enter and leave the sequence-parallel region the DTensor way (split / all-gather)
            local = DTensor.from_local(x, mesh["tp"], [Replicate()]).redistribute(mesh["tp"], [Shard(0)]).to_local()
            out = DTensor.from_local(model(local), mesh["tp"], [Shard(0)]).full_tensor()
        else:
            out = model(x)
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
    model = parallelize(Transformer(LAYERS, H, HEADS, device=DEVICE), layout, sequence_parallel=sp)
    x, target = batches()[0]
    with CollectiveRecorder() as rec:
        regression.mse(
            model(local_batch(x, layout.dp_group, dim=1)), local_batch(target, layout.dp_group, dim=1)
        ).backward()
    return events(rec)


def bad_input(layout) -> dict[str, str]:
    errors = {}

    def capture(key, build):
        try:
            shard_tp_model(build(), layout)
        except ParallelConfigError as error:
            errors[key] = str(error)

    def full_weight():
        model = parallelize(Transformer(1, H, HEADS, device=DEVICE), layout)
        model.layers[0].attention.qkv.weight = torch.nn.Parameter(torch.zeros(3 * H, H))
        return model

    def uneven_plain_parameter():  # not TP-aware, and shaped differently on the two TP ranks
        model = parallelize(Transformer(1, H, HEADS, device=DEVICE), layout)
        model.layers[0].register_parameter("extra", torch.nn.Parameter(torch.zeros(3 + 2 * layout.tp_rank)))
        return model

    capture("unsharded_model", lambda: Transformer(1, H, HEADS, device=DEVICE))
    capture("full_weight", full_weight)
    capture("uneven_plain_parameter", uneven_plain_parameter)
    return errors


def results(device: torch.device) -> dict:
    """Both configurations (plain, sp) against their oracles; the bad-input errors (CPU, TP 2 x DP 2)."""
    assert device.type == "cpu", "runs on the CPU"
    rank = dist.get_rank()
    assert dist.get_world_size() == 4, "run on 4 ranks"
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


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()

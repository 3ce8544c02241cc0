"""Worker for test_data_parallel.py: `torchrun --nproc-per-node 4 data_parallel_worker.py OUTDIR`.

Trains the test transformer for a few SGD steps in every data-parallel configuration the tests check, next to
its oracles (single-process training on the whole global batch from the same seed; torch's
DistributedDataParallel on the same groups), under a CollectiveRecorder. Each rank writes OUTDIR/rank{r}.json:
max differences, per-step recorded all-reduces (group, bytes, phase, issued before the last gradient?), the
bucket layouts (ours and torch's `_compute_bucket_assignment_by_size`) and bad-input errors.
"""

from __future__ import annotations

import time

import regression
import torch
import torch.distributed as dist
from common import full_tensor, max_diff, serve

from reference.data_parallel import DistributedDataParallel, finalize_model_grads, local_batch
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.tensor_parallel.parallelize import parallelize
from reference.tensor_parallel.transformer import Transformer

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
        module = Transformer(LAYERS, H, HEADS, device=DEVICE)
    else:
        module = parallelize(
            Transformer(LAYERS, H, HEADS, device=DEVICE), tp_group, sequence_parallel=sequence_parallel
        )
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
            loss = regression.mse(model(local_batch(x, group, dim=1)), local_batch(target, group, dim=1))
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
    module = Transformer(LAYERS, H, HEADS, device=DEVICE)
    model = DistributedDataParallel(module, group, bucket_size=BUCKET)
    x, target = (local_batch(t, group, dim=1) for t in batches(1)[0])
    per_micro = []
    with CollectiveRecorder() as rec:
        for i, (xm, tm) in enumerate(zip(x.chunk(micro_batches, dim=1), target.chunk(micro_batches, dim=1))):
            rec.clear()
            if i < micro_batches - 1:
                with model.no_sync():
                    (regression.mse(model(xm), tm) / micro_batches).backward()
            else:
                (regression.mse(model(xm), tm) / micro_batches).backward()
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
        lambda: DistributedDataParallel(Transformer(1, H, HEADS, device=DEVICE), group, bucket_size=0),
    )
    capture(
        "bucket_size_negative",
        lambda: DistributedDataParallel(Transformer(1, H, HEADS, device=DEVICE), group, bucket_size=-5),
    )
    capture("batch_not_divisible", lambda: local_batch(torch.zeros(6, 2), group))
    fused = parallelize(Transformer(1, H, HEADS, device=DEVICE), tp_group, gradient_accumulation_fusion=True)
    capture("main_grad", lambda: DistributedDataParallel(fused, group))
    twice = DistributedDataParallel(Transformer(1, H, HEADS, device=DEVICE), group, bucket_size=None)
    x = torch.randn(S, 2, H)
    twice(x).sum().backward()  # the one bucket goes on the wire during this backward
    capture("grad_twice", lambda: twice(x).sum().backward())  # a second synced backward: refused
    twice.finish_grad_sync()
    twice.remove_hooks()
    with CollectiveRecorder() as rec:  # detached: backward neither communicates nor refuses
        twice(x).sum().backward()
        twice(x).sum().backward()
    errors["collectives_after_remove_hooks"] = len(rec.events)
    return errors


def results(device: torch.device) -> dict:
    """Every configuration's differences, recorded steps and buckets; the bad-input errors (CPU, 4 ranks)."""
    assert device == DEVICE, "runs on the CPU"
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world == 4, "run on 4 ranks"
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
    params = list(Transformer(LAYERS, H, HEADS, device=DEVICE).parameters())
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


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()

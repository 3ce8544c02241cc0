"""Worker for test_distributed_optimizer.py: `torchrun --nproc-per-node 4 distributed_optimizer_worker.py OUTDIR`
(or in a shared launch, workers/shared_worker.py).

Trains the bf16 test transformer with Adam for a few steps over DP 4 (all ranks) and DP 2 (pairs [0,1], [2,3]):
the oracle is the unsharded mixed precision optimizer (fp32 master weights, fp32 main_grad buckets all-reduced,
Megatron's Float16OptimizerWithFloat16Params), next to the distributed optimizer (reduce-scatter, step the
slice, all-gather) with and without overlapping the all-gathers with the next forward, and both again with
bf16 gradients. Each rank writes OUTDIR/rank{r}.json: differences against the oracle (parameters, this rank's
fp32 master slices, losses), bytes per rank, the recorded collectives of every step, mixed-precision facts and
bad-input errors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from common import max_diff, serve

from reference.data_parallel import DistributedDataParallel, local_batch
from reference.data_parallel.buckets import padded_numel
from reference.data_parallel.distributed_optimizer import DistributedOptimizer, bytes_per_rank
from reference.data_parallel.mixed_precision import unsharded
from reference.measure.recorder import CollectiveRecorder
from reference.tensor_parallel.transformer import Transformer
from tests.reference import regression

H, HEADS, LAYERS, S, B, STEPS, SEED, LR = 16, 4, 2, 8, 8, 3, 1234, 1e-3
FFN = 61  # an odd MLP width: buckets of odd sizes, so the slices need padding at DP 2 and 4
DEVICE = torch.device("cpu")
BUCKET = 4096  # bytes of bf16 parameters: several buckets, several slices per bucket
CONFIGS = {  # name: (use_distributed_optimizer, overlap_param_gather, fp32 gradients)
    "oracle": (False, False, True),
    "distopt": (True, False, True),
    "distopt/overlap_param_gather": (True, True, True),
    "oracle/bf16_grads": (False, False, False),
    "distopt/bf16_grads": (True, False, False),
}


def adam(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(tensors, lr=LR)


def train(group, config: str) -> dict:
    use_distopt, overlap_param_gather, fp32_grads = CONFIGS[config]
    torch.manual_seed(SEED)
    module = Transformer(LAYERS, H, HEADS, ffn_hidden_size=FFN, params_dtype=torch.bfloat16, device=DEVICE)
    model = DistributedDataParallel(
        module,
        group,
        bucket_size=BUCKET,
        grad_dtype=torch.float32 if fp32_grads else None,
        use_distributed_optimizer=use_distopt,
        overlap_param_gather=overlap_param_gather,
    )
    optimizer = DistributedOptimizer(model, adam) if use_distopt else unsharded(model, adam)
    losses, steps, facts = [], [], {}
    for x, target in regression.batches(STEPS, S, B, H):
        with CollectiveRecorder() as rec:
            out = model(local_batch(x, group, dim=1).to(torch.bfloat16))
            loss = regression.mse(out.float(), local_batch(target, group, dim=1))
            loss.backward()
            if not facts:
                facts = {
                    "param_dtype": str(next(module.parameters()).dtype),
                    "grad_is_none": all(p.grad is None for p in module.parameters()) if fp32_grads else None,
                    "main_grad_dtype": str(next(module.parameters()).main_grad.dtype) if fp32_grads else None,
                    "master_dtypes": sorted({str(m.dtype) for m in optimizer.masters}),
                }
            model.finish_grad_sync()
            with rec.scope("step"):
                optimizer.step()
            model.zero_grad()
        steps.append(
            [
                {
                    "op": e.op,
                    "group": list(e.group_ranks),
                    "nbytes": e.nbytes,
                    "dtype": e.dtype,
                    "phase": e.phase,
                    "in_step": e.module == "step",
                }
                for e in rec.events
            ]
        )
        losses.append(regression.mean_over(loss.item(), group))
    model.finish_param_sync()
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    masters = flat_masters(model, optimizer, use_distopt)
    rounded = [m.to(torch.bfloat16) for m in masters]
    model_flat = [
        bucket.shard if use_distopt else torch.cat([p.detach().reshape(-1) for p in bucket.params])
        for bucket in (model.param_buckets or model.buckets)
    ]
    facts["master_rounds_to_param"] = all(torch.equal(r, p) for r, p in zip(rounded, model_flat))
    facts["master_finer_than_param"] = sum(int((m != p.float()).sum()) for m, p in zip(masters, model_flat))
    numel = sum(b.numel for b in model.buckets)
    padded = sum(padded_numel(b.numel, group.size()) for b in model.buckets)
    return {
        "losses": losses,
        "steps": steps,
        "params": params,
        "masters": masters,
        "facts": facts,
        "bytes": bytes_per_rank(model, optimizer),
        "numel": numel,
        "padded_numel": padded,
        "buckets": len(model.buckets),
    }


def flat_masters(model, optimizer, use_distopt: bool) -> list[torch.Tensor]:
    """Per bucket, the fp32 masters this rank holds: its slice (distributed), or the bucket's parameters'
    masters laid end to end (unsharded)."""
    if use_distopt:
        return [m.detach().clone() for m in optimizer.masters]
    by_param = dict(zip(optimizer.model_tensors, optimizer.masters))
    return [torch.cat([by_param[p].reshape(-1) for p in bucket.params]) for bucket in model.buckets]


def compare(run: dict, oracle: dict, group) -> dict:
    """Largest differences of `run` from `oracle`: bf16 parameters, this rank's fp32 master slices, losses."""
    size, rank = group.size(), group.rank()
    slices = []
    for full in oracle["masters"]:
        padded = torch.cat([full, full.new_zeros(padded_numel(full.numel(), size) - full.numel())])
        slices.append(padded.chunk(size)[rank])
    return {
        "params": max_diff(run["params"], oracle["params"]),
        "params_bitwise": all(torch.equal(run["params"][n], oracle["params"][n]) for n in oracle["params"]),
        "masters": max((a - b).abs().max().item() for a, b in zip(run["masters"], slices)),
        "losses": max(abs(a - b) for a, b in zip(run["losses"], oracle["losses"])),
    }


def bad_input(group) -> dict[str, str]:
    errors = {}

    def capture(key, fn):
        try:
            fn()
        except ValueError as error:
            errors[key] = str(error)

    plain = DistributedDataParallel(Transformer(1, H, HEADS, device=DEVICE), group)
    capture("distopt_on_plain_ddp", lambda: DistributedOptimizer(plain, adam))
    capture(
        "overlap_param_gather_without_distopt",
        lambda: DistributedDataParallel(Transformer(1, H, HEADS, device=DEVICE), group, overlap_param_gather=True),
    )
    sharded = DistributedDataParallel(Transformer(1, H, HEADS, device=DEVICE), group, use_distributed_optimizer=True)
    capture("unsharded_on_sharded_ddp", lambda: unsharded(sharded, adam))
    return errors


def results(_device: torch.device) -> dict:
    """Every configuration at DP 4 and DP 2 with its differences from the oracle, and the bad-input errors (CPU)."""
    assert dist.get_world_size() == 4, "run on 4 ranks"
    halves, _ = dist.new_subgroups(2)
    result = {"rank": dist.get_rank(), "dp": {}}
    for dp, group in (("dp4", dist.group.WORLD), ("dp2", halves)):
        runs = {config: train(group, config) for config in CONFIGS}
        entry = {"size": group.size(), "runs": {}}
        for config, run in runs.items():
            oracle = runs["oracle/bf16_grads" if config.endswith("bf16_grads") else "oracle"]
            entry["runs"][config] = {
                "diff": compare(run, oracle, group) if run is not oracle else None,
                **{k: run[k] for k in ("steps", "facts", "bytes", "numel", "padded_numel", "buckets", "losses")},
            }
        result["dp"][dp] = entry
    result["bad_input"] = bad_input(dist.group.WORLD)
    return result


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()

"""Worker for the recomputation and activation-memory tests: `torchrun ... activation_worker.py OUTDIR`
(the device from REFERENCE_TEST_DEVICE; or in a shared launch, workers/shared_worker.py).

At the launch's world size t (1 or 2): trains a two-block parallelized Transformer for two steps with dropout, in
every recompute mode (and, at t > 1, with and without sequence parallelism), and records whether each mode's
losses and gradients equal the no-recompute run's bit for bit; a control run recomputes the attention core
without restoring the TP dropout stream, to show that restoring it is what makes them equal. On CPU it also
counts the bytes one block, GPT-2 and Llama, saves for backward in every configuration of Korthikanti et al.'s
Table 2 that the world allows (reference.measure.activation_memory). Each rank writes OUTDIR/rank{r}.json.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from common import max_diff, serve

import reference.recompute
from reference.measure.activation_memory.measure import count, count_all
from reference.recompute import RECOMPUTE_MODES
from reference.tensor_parallel.parallelize import parallelize
from reference.tensor_parallel.transformer import Transformer

S, B, H, A, LAYERS, SEED, STEPS, DROPOUT = 8, 2, 16, 4, 2, 11, 2, 0.25
COUNT_SHAPE = dict(s=32, b=2, h=64, a=4)  # s != h / a, so the s^2 tensors are told apart by shape
LLAMA_COUNT_SHAPE = dict(COUNT_SHAPE, k=2, f=160)  # k < a (grouped-query), f not 4h: both show in the bytes


def train(device, tp_group, sequence_parallel: bool, recompute: str, dtype) -> tuple[list[float], dict]:
    """Losses and this rank's parameter and input gradients after STEPS forward-backward passes."""
    torch.manual_seed(SEED)
    model = parallelize(
        Transformer(LAYERS, H, A, hidden_dropout=DROPOUT, attention_dropout=DROPOUT, params_dtype=dtype, device=device),
        tp_group,
        dropout_seed=SEED,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
    )
    losses, grads = [], {}
    for step in range(STEPS):
        x = torch.randn(S, B, H, device=device, dtype=dtype, requires_grad=True)
        weights = torch.randn(S, B, H, device=device, dtype=dtype)
        loss = (model(x) * weights).sum()
        loss.backward()
        losses.append(loss.item())
        grads[f"step{step}.input"] = x.grad
    grads.update({name: p.grad for name, p in model.named_parameters()})
    return losses, grads


def compare(reference_run, run) -> dict:
    (losses0, grads0), (losses, grads) = reference_run, run
    return {
        "losses_equal": losses == losses0,
        "grads_equal": all(torch.equal(grads[n], grads0[n]) for n in grads0),
        "max_grad_diff": max_diff(grads, grads0),
    }


def recompute_results(device, tp_group) -> dict:
    """{layout: {mode or control: comparison with recompute "none"}} for fp32 and bf16."""
    results = {}
    layouts = [False, True] if tp_group.size() > 1 else [False]
    for dtype in (torch.float32, torch.bfloat16):
        for sp in layouts:
            name = f"t{tp_group.size()}{'_sp' if sp else ''}_{str(dtype).removeprefix('torch.')}"
            baseline = train(device, tp_group, sp, "none", dtype)
            results[name] = {
                mode: compare(baseline, train(device, tp_group, sp, mode, dtype)) for mode in RECOMPUTE_MODES[1:]
            }
            replaying = reference.recompute._replaying
            reference.recompute._replaying = lambda function, rng: function  # the control: no TP stream replay
            try:
                results[name]["selective_without_tp_stream_replay"] = compare(
                    baseline, train(device, tp_group, sp, "selective", dtype)
                )
            finally:
                reference.recompute._replaying = replaying
    return results


def memory_counts(device, world: int, model: str, shape: dict) -> list[dict]:
    """Table 2's configurations that fit this world, counted on rank-local blocks."""
    single = [dist.new_group([r]) for r in range(world)][dist.get_rank()]  # every rank creates every group
    if world == 1:
        return [count(model, "no parallelism", shape, tp_group=dist.group.WORLD, device=device).to_dict()]
    groups = {1: single, world: dist.group.WORLD}
    return [c.to_dict() for c in count_all(model, shape, tp_groups=groups, device=device)]


def results(device: torch.device) -> dict:
    """The recompute comparisons at this world, and on CPU the activation-memory counts."""
    world = dist.get_world_size()
    result = {"recompute": recompute_results(device, dist.group.WORLD)}
    if device.type == "cpu":
        result["activation_memory"] = memory_counts(device, world, "gpt2", COUNT_SHAPE)
        result["activation_memory_llama"] = memory_counts(device, world, "llama", LLAMA_COUNT_SHAPE)
    return result


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()

"""The reference FSDP2's recorded runs next to PyTorch's `fully_shard` (`fsdp2_results`, once a rank per device).

Each rank trains the odd-sized test GPT of fsdp_runs (every parameter's dim 0 needs padding at world 2 and 4)
for a few SGD steps with reference.fsdp2 and with torch's `fully_shard`, from the same weights on the same
batches, in each configuration the tests check, under one `CollectiveRecorder` with both FSDP2s' group
scopes (reference.measure.fsdp_tracing). What the rank observed: each step's loss, the largest difference of
its sharded gradients and final shards from `fully_shard`'s (plain tensors against DTensors' local tensors:
the same rows), each step's collectives and issue order, the bytes of its shards, and the largest difference
from single-process training.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist

from reference.fsdp.units import padded_shard_bytes, shard_model
from reference.gpt.model import GPT
from reference.gpt.train import split_batch, synthetic_batches
from reference.measure.fsdp_tracing import issue_order, unit_scopes
from reference.measure.recorder import CollectiveRecorder
from tests.reference.fsdp_runs import BATCH, BF16, CONFIG, LR, SEED
from tests.reference.helpers import max_diff

BOTH = ("reference-fsdp2", "fsdp2")
STEPS = 2  # the first step, and one that starts from stepped shards (and, for the reference FSDP1, a recorded order)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows: a DTensor's local tensor, or the reference's plain shard."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach().float().cpu().clone()


def configs(world: int) -> dict[str, dict]:
    """name -> shard_model options (and `backward_prefetch_depth`: explicit backward prefetch of the units that
    many back in forward order, from each unit's pre-backward)."""
    found = {"fp32": {}, "bf16": dict(BF16), "explicit": dict(forward_prefetch=True, backward_prefetch_depth=2)}
    if world == 2:
        found["keep"] = dict(reshard_after_forward=False)
    if world == 4:
        found["reshard2"] = dict(reshard_after_forward=2, **BF16)
        found["hsdp"] = dict(replicas=2, forward_prefetch=True)
    return found


def train(model, device, world, rank, recorder, prefetches) -> dict:
    """STEPS SGD steps on this rank's slice of each global batch: losses, sharded gradients, schedules."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for tokens in synthetic_batches(CONFIG, STEPS, BATCH, SEED):
        ((inputs, labels),) = split_batch(tokens.to(device), world, rank, 1)
        recorder.clear()
        loss = model(inputs, labels)
        loss.backward()
        grads = {name: local(p.grad) for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        steps.append(
            {
                "loss": loss.item(),
                "grads": grads,
                "events": [(e.op, e.group_ranks, e.nbytes, e.dtype, e.phase, e.module) for e in recorder.events],
                "issue_order": [
                    (e["phase"], e["op"], e["unit"], e.get("prefetch")) for e in issue_order(recorder, prefetches)
                ],
            }
        )
    return {"steps": steps, "shards": {name: local(p) for name, p in model.named_parameters()}}


def shard(initial, implementation, device, options: dict):
    options = dict(options)
    depth = options.pop("backward_prefetch_depth", 0)
    model = shard_model(copy.deepcopy(initial), implementation, dist.group.WORLD, **options)
    backward = [model, *reversed(model.layers)]  # the backward order: the root's hook fires first
    for index, unit in enumerate(backward if depth else ()):
        if targets := backward[index + 1 : index + 1 + depth]:
            unit.set_modules_to_backward_prefetch(targets)
    return model


@functools.cache
def fsdp2_results(device: torch.device) -> dict:
    """What this rank observed, per configuration and implementation (computed once a rank and device)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    initial = GPT(CONFIG, SEED, device)
    single = copy.deepcopy(initial)
    optimizer = torch.optim.SGD(single.parameters(), lr=LR)
    for tokens in synthetic_batches(CONFIG, STEPS, BATCH, SEED):
        single(*split_batch(tokens.to(device), 1, 0, 1)[0]).backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = {name: p.detach().float().cpu() for name, p in single.named_parameters()}
    result: dict = {"runs": {}, "single": {}}
    with CollectiveRecorder() as recorder:
        for name, options in configs(world).items():
            for implementation in BOTH:
                model = shard(initial, implementation, device, options)
                with unit_scopes(model) as prefetches:
                    run = train(model, device, world, rank, recorder, prefetches)
                run["shard_bytes"] = padded_shard_bytes(model)
                result["runs"][name, implementation] = run
                if implementation == "reference-fsdp2":
                    result["single"][name] = max_diff(model.full_parameters(), expected)
    return result


def differences(result: dict, name: str) -> dict[str, float]:
    """The reference against `fully_shard` in configuration `name`: largest loss, gradient and shard gaps."""
    ours, theirs = (result["runs"][name, implementation] for implementation in BOTH)
    pairs = list(zip(ours["steps"], theirs["steps"], strict=True))
    return {
        "loss": max(abs(a["loss"] - b["loss"]) for a, b in pairs),
        "grads": max(max_diff(a["grads"], b["grads"]) for a, b in pairs),
        "shards": max_diff(ours["shards"], theirs["shards"]),
    }

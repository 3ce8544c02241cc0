"""The reference FSDP's recorded runs every FSDP test reads (`fsdp_results`, computed once a rank per device).

Each rank trains the test GPT (reference.gpt.model.GPT) a few steps with the reference FSDP in every
configuration the tests check, and with the oracles (single-process training from the same weights, PyTorch
FSDP1 with the same wrapping and options, PyTorch FSDP2 `fully_shard`), under one `CollectiveRecorder`. What
the rank observed: parameter differences, each step's collective schedule with unit attribution, compute
spans, unsharded-memory samples, flat sizes and bad-input errors.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.utils._python_dispatch import TorchDispatchMode

from reference.fsdp import FullyShardedDataParallel
from reference.fsdp.units import shard_model
from reference.fsdp.wrapper import clean_name
from reference.gpt.model import GPT, GPTConfig
from reference.gpt.train import split_batch, synthetic_batches
from reference.measure.fsdp_tracing import unit_scopes
from reference.measure.recorder import CollectiveRecorder
from tests.reference.helpers import max_diff

# Odd sizes on purpose: every unit's flat size is odd, so every world size > 1 needs padding.
CONFIG = GPTConfig(vocab_size=101, hidden_size=27, num_attention_heads=3, num_layers=3, seq_length=16)
STEPS, BATCH, SEED, LR = 3, 4, 7, 0.05
PREFETCH = {"pre": "BACKWARD_PRE", "post": "BACKWARD_POST", "none": None}
BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class UnshardedMemorySampler(TorchDispatchMode):
    """Samples every unit's allocated unsharded bytes at each aten op (consecutive duplicates dropped)."""

    def __init__(self, handles) -> None:
        super().__init__()
        self.handles, self.samples = handles, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        sample = [h.unsharded_param_bytes() for h in self.handles]
        if not self.samples or self.samples[-1] != sample:
            self.samples.append(sample)
        return func(*args, **(kwargs or {}))


def train(
    model: nn.Module,
    recorder: CollectiveRecorder,
    device: torch.device,
    world: int,
    rank: int,
    optimizer_class=torch.optim.SGD,
    sampler_handles=None,
) -> list[dict]:
    """STEPS optimizer steps on this rank's slice of each global batch; the recorded schedule per step."""
    optimizer = optimizer_class(model.parameters(), lr=LR)
    steps = []
    for tokens in synthetic_batches(CONFIG, STEPS, BATCH, SEED):
        ((inputs, labels),) = split_batch(tokens.to(device), world, rank, 1)
        recorder.clear()
        sampler = UnshardedMemorySampler(sampler_handles) if sampler_handles else None
        if sampler:
            sampler.__enter__()
        model(inputs, labels).backward()
        if sampler:
            sampler.__exit__(None, None, None)
        optimizer.step()
        optimizer.zero_grad()
        record = recorder.to_dict()
        steps.append(
            {
                "events": [
                    {k: e[k] for k in ("op", "module", "phase", "nbytes", "dtype", "start", "end")}
                    for e in record["events"]
                ],
                "spans": record["spans"],
                "memory_samples": sampler.samples if sampler else None,
            }
        )
    return steps


def full_parameters(model: nn.Module, implementation: str) -> dict[str, torch.Tensor]:
    if implementation == "reference":
        return model.full_parameters()
    if implementation == "fsdp1":
        with FSDP1.summon_full_params(model):
            return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}
    if implementation == "fsdp2":
        return {name: p.full_tensor().detach().float().cpu() for name, p in model.named_parameters()}
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


@functools.cache
def fsdp_results(device: torch.device) -> dict:
    """What this rank observed in every configuration (computed once a rank and device: the tests read it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    result: dict = {"rank": rank, "world": world, "runs": {}, "diff": {}}
    initial = GPT(CONFIG, SEED, device)
    with CollectiveRecorder() as recorder:
        baseline = copy.deepcopy(initial)
        train(baseline, recorder, device, 1, 0)
        expected = full_parameters(baseline, "single")

        def run(name: str, implementation: str, **options) -> dict:
            model = shard_model(copy.deepcopy(initial), implementation, group, **options)
            handles = model.handles() if implementation == "reference" else None
            with unit_scopes(model):
                steps = train(model, recorder, device, world, rank, sampler_handles=handles)
            final = full_parameters(model, implementation)
            result["runs"][name] = {"steps": steps}
            if implementation == "reference":
                result["runs"][name]["units"] = [
                    {
                        "name": h.name,
                        "param_numel": h.param_numel,
                        "numel": h.numel,
                        "padded_numel": h.padded_numel,
                        "shard_numel": h.shard_numel,
                        "itemsize": h._local_shard.element_size(),
                        "full_bytes": h.padded_numel * h._full_param_padded.element_size(),
                    }
                    for h in model.handles()
                ]
                result["runs"][name]["param_bytes_per_rank"] = sum(h.sharded_param_bytes() for h in model.handles())
            elif implementation == "fsdp1":
                result["runs"][name]["shard_numel"] = {
                    n: h.flat_param._sharded_size.numel() for n, h in _fsdp1_handles(model).items()
                }
            result["diff"][f"{name}/single"] = max_diff(final, expected)
            return final

        params = {}

        policies = ["pre", "post", "none"] if world > 1 else ["pre"]
        for policy in policies:
            for forward_prefetch in (False, True):
                name = f"{policy}{'+fwd' if forward_prefetch else ''}"
                options = dict(backward_prefetch=PREFETCH[policy], forward_prefetch=forward_prefetch)
                ours = params[f"reference/{name}"] = run(f"reference/{name}", "reference", **options)
                if world > 1:  # FSDP1 at world 1 switches to NO_SHARD (all-reduce), nothing to compare
                    theirs = run(f"fsdp1/{name}", "fsdp1", **options)
                    result["diff"][f"reference/{name}/fsdp1"] = max_diff(ours, theirs)
        ours = run("reference/bf16", "reference", forward_prefetch=True, **BF16)
        if world > 1:
            theirs = run("fsdp1/bf16", "fsdp1", forward_prefetch=True, **BF16)
            result["diff"]["reference/bf16/fsdp1"] = max_diff(ours, theirs)
            result["diff"]["reference/pre/fsdp2"] = max_diff(params["reference/pre"], run("fsdp2", "fsdp2"))
            result["diff"]["reference/bf16/fsdp2"] = max_diff(ours, run("fsdp2/bf16", "fsdp2", **BF16))
        run("reference/cpu_offload", "reference", cpu_offload=True)
        if world > 1:
            result["diff"]["reference/adam/fsdp1"] = adam_diff(initial, group, recorder, device)
    result["bad_input"] = bad_input_errors(group)
    return result


def adam_diff(initial, group, recorder, device) -> float:
    """Adam's per-element state lives on the shard views of the original parameters. Compared with FSDP1
    (bitwise-equal gradients) rather than single-process training: Adam's m/sqrt(v) turns the 1e-8
    reduction-order noise of near-zero gradients into O(lr) updates."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for implementation in ("reference", "fsdp1"):
        model = shard_model(copy.deepcopy(initial), implementation, group)
        train(model, recorder, device, world, rank, optimizer_class=torch.optim.Adam)
        results.append(full_parameters(model, implementation))
    return max_diff(*results)


def bad_input_errors(group) -> dict[str, str]:
    """The one-line error each bad wrapping raises (ValueError), keyed by case."""
    errors = {}

    def expect_error(case, build):
        try:
            build()
        except ValueError as error:
            errors[case] = str(error)
        else:
            errors[case] = "no error"

    def shared_between_units():
        model = GPT(dataclasses.replace(CONFIG, share_embeddings_and_output_weights=True), SEED)
        model.output_layer = FullyShardedDataParallel(model.output_layer, group)  # the tied head in its own unit
        FullyShardedDataParallel(model, group)

    def wrapped_twice():
        block = GPT(CONFIG, SEED).layers[0]
        FullyShardedDataParallel(block, group)
        FullyShardedDataParallel(block, group)

    def wrapper_wrapped():
        FullyShardedDataParallel(FullyShardedDataParallel(GPT(CONFIG, SEED).layers[0], group), group)

    def integer_parameter():
        module = nn.Linear(3, 3)
        module.step = nn.Parameter(torch.zeros(1, dtype=torch.long), requires_grad=False)
        FullyShardedDataParallel(module, group)

    def partly_frozen():
        module = nn.Linear(3, 3)
        module.bias.requires_grad_(False)
        FullyShardedDataParallel(module, group)

    expect_error("partly_frozen", partly_frozen)
    expect_error("shared_between_units", shared_between_units)
    expect_error("wrapped_twice", wrapped_twice)
    expect_error("wrapper_wrapped", wrapper_wrapped)
    expect_error("integer_parameter", integer_parameter)
    return errors


def _fsdp1_handles(model):
    return {clean_name(n) or "root": m._handle for n, m in model.named_modules() if isinstance(m, FSDP1) and m._handle}


def schedule(step: dict, phase: str | None = None) -> list[tuple]:
    """(op, unit, phase, nbytes, dtype) of each collective in issue order."""
    return [
        (e["op"], e["module"], e["phase"], e["nbytes"], e["dtype"])
        for e in step["events"]
        if phase is None or e["phase"] == phase
    ]


def issued(step: dict, op: str, unit: str, phase: str) -> float:
    """Issue time of the one `op` of `unit` in `phase` of a recorded step."""
    starts = [e["start"] for e in step["events"] if (e["op"], e["module"], e["phase"]) == (op, unit, phase)]
    assert len(starts) == 1, f"expected one {phase} {op} of {unit}, found {len(starts)}"
    return starts[0]


def span(step: dict, name: str) -> dict:
    spans = [s for s in step["spans"] if s["name"] == name]
    assert len(spans) == 1, f"expected one span {name!r}, found {len(spans)}"
    return spans[0]

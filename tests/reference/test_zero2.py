"""ZeRO-2 (reference.data_parallel.gradient_shards) against DDP, ZeRO-1 and torch FSDP1's SHARD_GRAD_OP.

At 2 CPU ranks the first test to ask (`results()`, once a rank) trains the test GPT three Adam steps of two
micro-batches each (the first under no_sync) with bf16 parameters and fp32 masters: the reference's DDP, ZeRO-1
and ZeRO-2, each with fp32 main grads and with bf16 gradients, in buckets of BUCKET bytes; and torch FSDP1 with
sharding_strategy=SHARD_GRAD_OP over the same initial values (one unit, bf16 compute over fp32 shards, fp32
reduce-scatters, each micro-batch reduce-scattered). The bytes are read from the tensors each rank holds.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist

from reference.__main__ import main
from reference.data_parallel import DistributedDataParallel
from reference.data_parallel.buckets import GradBucket, padded_numel
from reference.data_parallel.distributed_optimizer import DistributedOptimizer, bytes_per_rank
from reference.data_parallel.gradient_shards import ShardedGradBucket, ShardedGradOptimizer
from reference.data_parallel.mixed_precision import unsharded
from reference.gpt.model import GPT, GPTConfig
from reference.gpt.train import split_batch, synthetic_batches
from reference.measure.recorder import CollectiveRecorder
from tests.ranks import on_ranks
from tests.reference.helpers import demo_output, json_lines
from tests.reference.refusals import refusal

WORLD = 2
CONFIG = GPTConfig(vocab_size=101, hidden_size=27, num_attention_heads=3, num_layers=2, seq_length=8)
STEPS, MICRO, ROWS, SEED, LR = 3, 2, 2, 7, 1e-3  # ROWS: sequences per micro-batch and rank
BUCKET = 8192  # bytes of bf16 parameters: 4 buckets, some of odd sizes, padded to a multiple of WORLD
BF16 = torch.bfloat16
RUNS = {  # name: (bucket class, optimizer, use_distributed_optimizer, fp32 main grads)
    "ddp": (GradBucket, unsharded, False, True),
    "zero1": (GradBucket, DistributedOptimizer, True, True),
    "zero2": (ShardedGradBucket, ShardedGradOptimizer, True, True),
    "ddp/bf16_grads": (GradBucket, unsharded, False, False),
    "zero1/bf16_grads": (GradBucket, DistributedOptimizer, True, False),
    "zero2/bf16_grads": (ShardedGradBucket, ShardedGradOptimizer, True, False),
}


def adam(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(tensors, lr=LR)


def micro_batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    batches = synthetic_batches(CONFIG, STEPS, ROWS * MICRO * WORLD, SEED)
    return [split_batch(tokens, WORLD, dist.get_rank(), MICRO) for tokens in batches]


def train(model, optimizer, no_sync, finish, zero_grad, after_backward=None) -> dict:
    """STEPS steps; per step the mean loss over ranks and micro-batches and the recorded collectives."""
    losses, steps = [], []
    for step in micro_batches():
        with CollectiveRecorder() as rec:
            total = 0.0
            for i, (inputs, labels) in enumerate(step):
                with no_sync() if i < len(step) - 1 else contextlib.nullcontext():
                    loss = model(inputs, labels) / len(step)
                    loss.backward()
                total += loss.item()
            finish()
            if after_backward:
                after_backward()
            with rec.scope("step"):
                optimizer.step()
        zero_grad()
        steps.append([(e.op, e.nbytes, e.dtype, e.phase, e.module == "step") for e in rec.events])
        mean = torch.tensor(total)
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    return {"losses": losses, "steps": steps}


def reference_run(name: str) -> dict:
    bucket_class, make, distributed, fp32_grads = RUNS[name]
    module = GPT(CONFIG, SEED, params_dtype=BF16)
    model = DistributedDataParallel(
        module,
        dist.group.WORLD,
        bucket_size=BUCKET,
        grad_dtype=torch.float32 if fp32_grads else None,
        use_distributed_optimizer=distributed,
        bucket_class=bucket_class,
    )
    optimizer = make(model, adam)
    during = {}

    def held_after_backward():  # the gradient bytes between the reduce-scatters and the step
        during["gradients"] = bytes_per_rank(model, optimizer)["gradients"]

    result = train(model, optimizer, model.no_sync, model.finish_grad_sync, model.zero_grad, held_after_backward)
    return {
        **result,
        "bytes": bytes_per_rank(model, optimizer),
        "gradients_after_backward": during["gradients"],
        "numel": sum(b.numel for b in model.buckets),
        "padded_numel": sum(padded_numel(b.numel, WORLD) for b in model.buckets),
        "buckets": len(model.buckets),
    }


def fsdp1_run() -> dict:
    """torch FSDP1, SHARD_GRAD_OP, one unit: bf16 compute over fp32 shards initialised to the reference's bf16
    values, fp32 reduce-scatter; its fp32 shards are its master weights."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    module = GPT(CONFIG, SEED)
    module.load_state_dict({k: v.float() for k, v in GPT(CONFIG, SEED, params_dtype=BF16).state_dict().items()})
    model = FSDP(
        module,
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32),
    )
    flat = model._handle.flat_param
    optimizer = adam(list(model.parameters()))
    during = {}

    def held_in_forward(*_):  # SHARD_GRAD_OP: whole bf16 parameters from forward to the end of backward
        during.setdefault("full_parameters", flat._full_param_padded.untyped_storage().nbytes())

    def held_after_backward():
        during.setdefault("gradients", flat.grad.numel() * flat.grad.element_size())

    module.register_forward_hook(held_in_forward)
    # no no_sync: FSDP1 reduce-scatters every micro-batch and adds the shards in fp32 (its no_sync would add
    # the unsharded gradients in bf16, the parameters' compute dtype)
    result = train(model, optimizer, contextlib.nullcontext, lambda: None, optimizer.zero_grad, held_after_backward)
    states = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    return {
        **result,
        "padded_numel": padded_numel(flat._unpadded_unsharded_size.numel(), WORLD),
        "shard_bytes": flat.numel() * flat.element_size(),
        "optimizer_states": sum(t.numel() * t.element_size() for t in states),
        **during,
    }


@functools.cache
def results() -> dict:
    """This rank's view of every run (computed once a rank: the tests read it)."""
    return {**{name: reference_run(name) for name in RUNS}, "fsdp1": fsdp1_run()}


@on_ranks(WORLD)
@pytest.mark.upstream("pytorch")
def test_zero2_trains_like_torch_fsdp1_shard_grad_op(ranks):
    """Same initial values, data and Adam: ZeRO-2's losses are FSDP1 SHARD_GRAD_OP's, to the bit. Both compute
    in bf16 rounded from fp32 masters and step Adam (elementwise) on fp32 mean gradients; ZeRO-2 adds the two
    micro-batches' bf16 gradients in fp32 before one reduce-scatter, FSDP1 reduce-scatters each and adds the
    fp32 shards, and sums of two bf16 values are exact in fp32, so the order changes no bit here."""
    ours, torch_fsdp1 = results()["zero2"], results()["fsdp1"]
    assert ours["losses"] == torch_fsdp1["losses"]


@on_ranks(WORLD)
def test_zero2_steps_bit_for_bit_like_zero1(ranks):
    """ZeRO-2 reduce-scatters what ZeRO-1 does and steps the same slices: the same losses to the bit."""
    for grads in ("", "/bf16_grads"):
        assert results()["zero2" + grads]["losses"] == results()["zero1" + grads]["losses"]


@on_ranks(WORLD)
def test_zero2_bytes_per_rank_are_the_zero_paper_accounting(ranks):
    """ZeRO (Rajbhandari et al. 2020), stage 2: 2Ψ bf16 parameters whole, then (2 + 12)Ψ/N_d of bf16 gradient
    shard, fp32 master and Adam's two moments; fp32 main grads make it (4 + 12)Ψ/N_d. Against ZeRO-1's
    2Ψ + 2Ψ + 12Ψ/N_d and DDP's 16Ψ (Ψ padded per bucket under ZeRO). Held between steps; the full fp32
    buffer exists only from a step's first gradient to its optimizer step."""
    runs, n = results(), WORLD
    psi = runs["zero2"]["padded_numel"]
    for name, grad_bytes, shards in (("zero2", 4, n), ("zero2/bf16_grads", 2, n), ("zero1/bf16_grads", 2, 1)):
        held = runs[name]["bytes"]
        assert held == {
            "parameters": 2 * psi,
            "gradients": grad_bytes * psi // shards,
            "master_weights": 4 * psi // n,
            "optimizer_states": 8 * psi // n,
        }, name
    assert sum(runs["zero2/bf16_grads"]["bytes"].values()) == 2 * psi + (2 + 12) * psi // n
    assert sum(runs["zero1/bf16_grads"]["bytes"].values()) == 2 * psi + 2 * psi + 12 * psi // n
    unpadded = runs["ddp/bf16_grads"]["numel"]
    assert sum(runs["ddp/bf16_grads"]["bytes"].values()) == (2 + 2 + 12) * unpadded
    assert runs["zero2"]["gradients_after_backward"] == 4 * psi + 4 * psi // n  # full buffer and its kept shard


@on_ranks(WORLD)
def test_torch_shard_grad_op_holds_what_zero2_holds_per_parameter(ranks):
    """FSDP1 SHARD_GRAD_OP holds its whole bf16 parameters from forward to the end of backward (2Ψ), and 1/N_d
    of fp32 gradients, fp32 shards (its masters) and Adam moments: ZeRO-2 with fp32 gradients, per element of
    its own padded Ψ."""
    fsdp1, n = results()["fsdp1"], WORLD
    psi = fsdp1["padded_numel"]
    assert psi % n == 0 and psi >= sum(p.numel() for p in GPT(CONFIG, SEED).parameters())
    assert fsdp1["full_parameters"] == 2 * psi
    assert (fsdp1["gradients"], fsdp1["shard_bytes"], fsdp1["optimizer_states"]) == (4 * psi // n,) * 2 + (
        8 * psi // n,
    )


@on_ranks(WORLD)
@pytest.mark.parametrize("grads", ["", "/bf16_grads"])
def test_zero2_reduce_scatters_then_all_gathers_each_bucket_once_a_step(ranks, grads):
    """Per step: nothing under no_sync, one reduce-scatter per bucket during the last micro-batch's backward (of
    the gradient dtype), then one bf16 all-gather per bucket in the step: ZeRO-1's sequence and bytes."""
    run, zero1 = results()["zero2" + grads], results()["zero1" + grads]
    psi, dtype, size = run["padded_numel"], "float32" if not grads else "bfloat16", 4 if not grads else 2
    for step, theirs in zip(run["steps"], zero1["steps"]):
        assert [e[0] for e in step] == ["reduce_scatter"] * run["buckets"] + ["all_gather"] * run["buckets"]
        scatters, gathers = step[: run["buckets"]], step[run["buckets"] :]
        assert {(e[2], e[3], e[4]) for e in scatters} == {(dtype, "backward", False)}
        assert {(e[2], e[4]) for e in gathers} == {("bfloat16", True)}
        assert sum(e[1] for e in scatters) == size * psi and sum(e[1] for e in gathers) == 2 * psi
        assert step == theirs


@functools.cache
def demo(dp_sharding: str) -> list[dict]:
    """The demo's --json records at dp 2: bf16 (fp32 main grads and masters), Adam, 2 steps of 4 micro-batches."""
    model = ["--vocab-size", "51", "--hidden-size", "16", "--seq-length", "8", "--num-layers", "2"]
    argv = ["--dp", "2", "--steps", "2", "--dtype", "bf16", "--optimizer", "adam", "--json", *model]
    return json_lines(demo_output([*argv, "--dp-sharding", dp_sharding]))


@on_ranks(WORLD)
def test_zero2_demo_reports_a_gradient_shard_per_rank(ranks):
    """`--dp-sharding gradients` against `optimizer`: the same losses and dp collectives per step, and a memory
    report whose gradients alone are 1/dp of ZeRO-1's (the padded fp32 buffer's)."""
    zero1, zero2 = demo("optimizer"), demo("gradients")
    steps1, steps2 = ([r for r in records if "step" in r] for records in (zero1, zero2))
    assert [s["loss"] for s in steps2] == [s["loss"] for s in steps1]
    assert [s["collectives"]["dp"] for s in steps2] == [s["collectives"]["dp"] for s in steps1]
    (memory1,), (memory2,) = ([r["memory"] for r in records if "memory" in r] for records in (zero1, zero2))
    for one, two in zip(memory1, memory2):
        assert two == {**one, "gradients": one["gradients"] // WORLD}


class OneUsedOfTwo(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@on_ranks(WORLD)
def test_zero2_reduce_scatters_a_bucket_no_gradient_reached(ranks):
    """A bucket whose parameters the forward never used (each Linear its own bucket) still reduce-scatters at
    finish_grad_sync, from a buffer allocated then, zeroed; the step sees a zero gradient shard for it."""
    torch.manual_seed(SEED)
    model = DistributedDataParallel(
        OneUsedOfTwo(), bucket_size=1, use_distributed_optimizer=True, bucket_class=ShardedGradBucket
    )
    optimizer = ShardedGradOptimizer(model, adam)
    with CollectiveRecorder() as rec:
        model(torch.ones(2, 4)).sum().backward()
        model.finish_grad_sync()
        optimizer.step()
    assert [e.op for e in rec.events] == ["reduce_scatter"] * 4 + ["all_gather"] * 4
    unused = {model._bucket_of[p] for p in model.module.unused.parameters()}
    assert all(b.freed and not b.kept.any() for b in unused)
    assert all(b.freed and b.kept.any() for b in model.buckets if b not in unused)


def test_zero2_at_dp_1_is_refused_with_one_line(capsys):
    stderr = refusal(main, ["--dp-sharding", "gradients"], capsys)
    assert stderr.strip() == (
        "reference: error: --dp-sharding gradients shards the gradients and the optimizer state over the "
        "data-parallel group, but dp is 1 (world 1 / (tp 1 x pp 1)): nothing to shard; launch more ranks or use "
        "--dp-sharding replicate"
    )


def test_zero2_needs_the_distributed_optimizer():
    """Constructed outside a process group: the bucket refuses before touching one."""
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        ShardedGradBucket([torch.nn.Parameter(torch.ones(2))], None, sharded=False)

"""`torchrun -m reference --cp N`: the GPT trains on head-tail shards of each sequence with ring attention and
prints the unsharded GPT's losses, alone and composed with TP, PP and DP; the ring's exchanges are counted on
the cp group; sizes CP cannot take are refused in one line before any process starts."""

from __future__ import annotations

import functools

import pytest

from reference.__main__ import main
from reference.gpt.model import GPTConfig
from tests.ranks import on_ranks
from tests.reference.helpers import demo_output, json_lines, unsharded_gpt_training
from tests.reference.refusals import refusal

B, M, STEPS, SEED, LR, SEQ = 2, 2, 2, 7, 0.5, 64


def cp_args(*extra: str) -> list[str]:
    """The issue's run (`--cp 2 --steps 2 --seq-length 64`, default model sizes) on a fixed batch, seed and lr."""
    return [
        *("--steps", str(STEPS), "--seq-length", str(SEQ), "--json"),
        *("--batch-size", str(B), "--micro-batches", str(M), "--seed", str(SEED), "--lr", str(LR)),
        *extra,
    ]


@functools.cache
def unsharded_losses(model: str, replicas: int = 1) -> list[float]:
    """What the 1-rank run with the same flags prints (the unsharded GPT on the same batches), on dp replicas'
    global batch."""
    config = GPTConfig(seq_length=SEQ, style=model, num_kv_heads=2 if model == "llama" else None)
    return unsharded_gpt_training(config, SEED, STEPS, LR, B * M * replicas).losses


def cp_steps(*extra: str) -> list[dict]:
    return [x for x in json_lines(demo_output(cp_args(*extra))) if "step" in x]


@on_ranks(2)
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_cp_2_demo_prints_the_losses_of_the_unsharded_gpt(ranks, model):
    """Learned positions (gpt2) and rotary (llama) both follow the shards; the ring exchanges K/V once per layer
    forward, K/V with dK/dV once and dK/dV home once in backward."""
    steps = cp_steps("--cp", "2", "--model", model)
    for got, expected in zip([s["loss"] for s in steps], unsharded_losses(model), strict=True):
        assert abs(got - expected) < 2e-6, (got, expected)
    cp = steps[0]["collectives"]["cp"]
    assert cp["send"]["count"] == cp["recv"]["count"] == 3 * 2 * M  # 2 layers, M micro-batches
    assert cp["all_reduce"]["count"] == 1  # gradients over dp x cp (here the cp group), one bucket


@on_ranks(4)
@pytest.mark.parametrize("sizes", [("--tp", "2"), ("--pp", "2"), ("--dp", "2")], ids=["tp2", "pp2", "dp2"])
def test_cp_2_composes_with_tp_pp_and_dp_at_the_unsharded_losses(ranks, sizes):
    steps = cp_steps("--cp", "2", *sizes)
    replicas = 2 if sizes[0] == "--dp" else 1
    for got, expected in zip([s["loss"] for s in steps], unsharded_losses("gpt2", replicas), strict=True):
        assert abs(got - expected) < 2e-6, (got, expected)


@on_ranks(2)
@pytest.mark.parametrize("sharding", ["optimizer", "gradients"], ids=["zero1", "zero2"])
def test_cp_2_shards_zero_over_dp_x_cp_at_the_unsharded_losses(ranks, sharding):
    """dp 1, cp 2: ZeRO-1 and ZeRO-2 have two ranks to shard over, the dp x cp group (megatron's distributed
    optimizer's), which is here the cp group: gradients reduce-scattered, parameters all-gathered on it, once a
    step (one bucket), no all-reduce."""
    steps = cp_steps("--cp", "2", "--dp-sharding", sharding)
    for got, expected in zip([s["loss"] for s in steps], unsharded_losses("gpt2"), strict=True):
        assert abs(got - expected) < 2e-6, (got, expected)
    cp = steps[0]["collectives"]["cp"]
    assert (cp["reduce_scatter"]["count"], cp["all_gather"]["count"], "all_reduce" in cp) == (1, 1, False)


@on_ranks(4)
@pytest.mark.parametrize("sharding", ["optimizer", "gradients"], ids=["zero1", "zero2"])
def test_cp_2_dp_2_shards_zero_over_the_four_dp_cp_ranks_at_the_unsharded_losses(ranks, sharding):
    steps = cp_steps("--cp", "2", "--dp", "2", "--dp-sharding", sharding)
    for got, expected in zip([s["loss"] for s in steps], unsharded_losses("gpt2", 2), strict=True):
        assert abs(got - expected) < 2e-6, (got, expected)
    collectives = steps[0]["collectives"]
    assert {op: c["count"] for op, c in collectives["dp_cp"].items()} == {"reduce_scatter": 1, "all_gather": 1}
    assert collectives["dp"] == {}  # nothing over dp alone


@pytest.mark.parametrize(
    "world, args, message",
    [
        (2, ["--cp", "2", "--seq-length", "66"], "--seq-length 66 does not split into 2 x cp 2 chunks"),
        (2, ["--cp", "3"], "the world size (2) is not divisible by tp 1 x cp 3 x pp 1 (3)"),
        (4, ["--cp", "2", "--tp", "2", "--dp", "2"], "tp 2 x cp 2 x pp 1 x dp 2 = 8 ranks, but the world has 4"),
        (2, ["--cp", "0"], "--cp 0: the context-parallel size must be >= 1"),
        (2, ["--cp", "2", "--sequence-parallel"], "--cp 2 does not compose with --sequence-parallel"),
        (2, ["--cp", "2", "--dropout", "0.1"], "--cp 2 does not compose with --dropout > 0"),
        (2, ["--cp", "2", "--dp-sharding", "fsdp2"], "--cp 2 does not compose with --dp-sharding fsdp2"),
    ],
)
def test_cp_sizes_that_cannot_work_are_refused_in_one_line(world, args, message, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))  # what torchrun would set: refused before any process group
    stderr = refusal(main, args, capsys)
    assert stderr.startswith(f"reference: error: {message}") and stderr.count("\n") == 1, stderr

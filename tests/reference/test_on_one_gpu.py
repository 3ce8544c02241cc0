"""The world-size-1 forms a one-GPU machine runs (NCCL takes one rank per GPU): the GPT demo in both block
styles and the FSDP demo train on the rank's device in `--dtype auto` (bf16 on CUDA, with fp32 main grads and
masters; fp32 on CPU) or bf16, and follow the single-process fp32 GPT within that dtype's bound. On CPU the
same bodies check the device handling: a bf16 run says so, auto stays fp32 and on CPU even on a gloo group
beside a GPU, and a benchmark's `--device cuda` without a GPU is one line and exit 2."""

from __future__ import annotations

import importlib

import pytest
import torch

from reference.distributed import distributed
from reference.gpt.model import GPTConfig
from tests.launch import ROOT
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES
from tests.reference.helpers import demo_output, json_lines, unsharded_gpt_training
from tests.reference.refusals import refusal

SIZES = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_layers=2, seq_length=8)
STEPS, SEED, LR, BATCH, MICRO = 3, 7, 0.5, 2, 2
# |loss - fp32 loss| / fp32 loss. fp32: the same sums (bitwise on CPU, cuBLAS's order on CUDA); bf16: every
# activation rounded to 8 bits of mantissa over 3 steps, observed 7e-5 (gpt2, llama) on CPU
TOLERANCE = {"fp32": 1e-6, "bf16": 1e-3}


def demo(*argv: str) -> list[dict]:
    """The demo's --json records (world 1 here), on the launch's device."""
    return json_lines(demo_output([*argv, "--json", "--steps", str(STEPS), "--seed", str(SEED), "--lr", str(LR)]))


def expected_dtype(dtype: str, device: torch.device) -> str:
    return {"auto": "bf16" if device.type == "cuda" else "fp32"}.get(dtype, dtype)


@on_ranks(1, devices=DEVICES, timeout_s=120)
@pytest.mark.parametrize("dtype", ["auto", "bf16"])
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_gpt_demo_on_one_rank_follows_the_fp32_model_in_its_dtype(ranks, model, dtype):
    sizes = [f"--{name.replace('_', '-')}={value}" for name, value in SIZES.items()]
    records = demo(
        *sizes, "--model", model, "--dtype", dtype, "--batch-size", str(BATCH), "--micro-batches", str(MICRO)
    )
    steps = [r for r in records if "step" in r]
    label = expected_dtype(dtype, ranks.device)
    assert [r["dtype"] for r in steps] == [label] * STEPS
    kv = dict(num_kv_heads=SIZES["num_attention_heads"] // 2) if model == "llama" else {}
    oracle = unsharded_gpt_training(GPTConfig(**SIZES, style=model, **kv), SEED, STEPS, LR, BATCH * MICRO)
    assert [r["loss"] for r in steps] == pytest.approx(oracle.losses, rel=TOLERANCE[label])
    assert steps[0]["param_bytes_per_rank"] == steps[0]["param_bytes_unsharded"]  # one rank holds it all


@on_ranks(1, devices=DEVICES, timeout_s=120)
@pytest.mark.parametrize("dtype", ["auto", "bf16"])
def test_fsdp_demo_on_one_rank_follows_the_fp32_model_in_its_dtype(ranks, dtype):
    config = GPTConfig(hidden_size=32, num_attention_heads=4, num_layers=2, seq_length=8)
    sizes = ["--hidden-size=32", "--num-attention-heads=4", "--num-layers=2", "--seq-length=8"]
    records = demo("--fsdp", *sizes, "--dtype", dtype, "--batch-size", str(BATCH))
    label = expected_dtype(dtype, ranks.device)
    assert [r["dtype"] for r in records] == [label] * STEPS
    oracle = unsharded_gpt_training(config, SEED, STEPS, LR, BATCH)
    assert [r["loss"] for r in records] == pytest.approx(oracle.losses, rel=TOLERANCE[label])
    gathered = {e["dtype"] for e in records[0]["events"] if e["op"] == "all_gather"}
    assert gathered == {"bfloat16" if label == "bf16" else "float32"}  # FSDP gathers in the compute dtype


@on_ranks(1, timeout_s=120)
def test_auto_on_a_gloo_group_is_the_cpu_even_beside_a_gpu(ranks):
    """A rank that set up gloo runs the demos and benchmarks it calls on the CPU, GPU or not."""
    with distributed("auto") as device:
        assert device == torch.device("cpu")


@pytest.mark.parametrize("script", ["bench_decoder", "bench_distopt"])
def test_a_benchmark_asked_for_cuda_without_a_gpu_refuses_in_one_line(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the scripts are imported by name, as run from there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    err = refusal(importlib.import_module(script).main, ["--device", "cuda"], capsys)
    assert err == f"{script}: error: --device cuda but no CUDA device is visible\n"

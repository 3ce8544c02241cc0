"""The "llama" style of the reference against Hugging Face transformers' own Qwen2ForCausalLM.

A third-party oracle (transformers is a test dependency, not a pinned source): a tiny Qwen2 with random weights
(biases and RMSNorm weights randomized too), loaded into the reference through reference.gpt.hf_weights. The
first test at a world runs what that world checks (`results()`, once a rank); each test asserts on its rank's:
  world 1 and 2: the unsharded reference and a TP = world stage (plain, sequence-parallel, and sequence-parallel
                 on a length TP does not divide): logits, loss and every gradient against HF's, and the stage's
                 collectives per phase;
  world 4:       TP 2 x DP 2 (DDP; FSDP with SP, fp32 and bf16 compute) and TP 2 x PP 2 (1F1B, 2 micro-batches,
                 SP on an uneven sequence): STEPS SGD losses against HF on the global batch, and (DDP) the
                 stage's parameters after them.
The config: vocab 128, hidden 64, 4 query heads in 2 key/value groups, 2 layers, SwiGLU 96, b 4, s 12 (and 11).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Qwen2ForCausalLM

from reference.fsdp import MixedPrecision
from reference.gpt.hf_weights import load_hf_into_stage, master_state_from_hf, qwen2_config, stage_state_from_master
from reference.gpt.model import GPT, GPTConfig
from reference.gpt.parallelize import build_stage
from reference.gpt.train import data_parallel, fully_sharded, synthetic_batches, train_step
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES
from tests.reference.helpers import max_diff

CONFIG = GPTConfig(
    style="llama",
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_kv_heads=2,
    num_layers=2,
    seq_length=12,
    ffn_hidden_size=96,
)
UNEVEN = dataclasses.replace(CONFIG, seq_length=11)  # not divisible by TP 2 (nor 4)
B, SEED, STEPS, LR = 4, 1234, 2, 0.5
EXACT = 1e-6  # fp32, same math in a different order


def hf_model(config: GPTConfig, device: torch.device) -> Qwen2ForCausalLM:
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(qwen2_config(config)).to(device)
    with torch.no_grad():  # HF initializes biases to 0 and norms to 1: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
    return model


def hf_step(model: Qwen2ForCausalLM, config: GPTConfig, tokens: torch.Tensor):
    """Logits [b, s, V], mean token loss, and the gradients in the reference's unsharded names."""
    model.zero_grad()
    tokens = tokens.to(model.device)
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = master_state_from_hf(config, {n: p.grad for n, p in model.named_parameters()})
    return logits.detach(), loss.item(), grads


def unsharded(config: GPTConfig, device: torch.device) -> dict:
    hf = hf_model(config, device)
    tokens = synthetic_batches(config, 1, B, SEED)[0].to(device)
    logits, loss, grads = hf_step(hf, config, tokens)
    ref = GPT(config, SEED, device=device)
    ref.load_state_dict(master_state_from_hf(config, hf.state_dict()))
    ours = ref.logits(tokens[:, :-1]).transpose(0, 1)
    our_loss = ref(tokens[:, :-1], tokens[:, 1:])
    our_loss.backward()
    return {
        "logits": (ours - logits).abs().max().item(),
        "loss": abs(our_loss.item() - loss),
        "grads": max_diff({n: p.grad for n, p in ref.named_parameters()}, grads),
    }


def tp_stage(config: GPTConfig, layout, sp: bool, device: torch.device) -> dict:
    """One TP stage (the whole model) against HF: this rank's logit columns, the loss, its gradient shards."""
    hf = hf_model(config, device)
    tokens = synthetic_batches(config, 1, B, SEED)[0].to(device)
    logits, loss, grads = hf_step(hf, config, tokens)
    stage = build_stage(config, layout, sequence_parallel=sp, seed=SEED, device=device)
    load_hf_into_stage(stage, hf.state_dict())
    with torch.no_grad():
        our_logits = stage.logits(tokens[:, :-1])[: config.seq_length].transpose(0, 1)
    columns = our_logits.shape[-1]
    their_logits = logits[..., layout.tp_rank * columns : (layout.tp_rank + 1) * columns]
    rec = CollectiveRecorder()
    rec.watch(stage)
    with rec:
        our_loss = stage(tokens[:, :-1], tokens[:, 1:])
        our_loss.backward()
    allreduce_sequence_parallel_grads(stage, layout.tp_group)
    expected = stage_state_from_master(stage, grads)
    return {
        "logits": (our_logits - their_logits).abs().max().item(),
        "loss": abs(our_loss.item() - loss),
        "grads": max_diff({n: p.grad for n, p in stage.named_parameters()}, expected),
        "events": [(e.op, e.module, e.phase, e.nbytes) for e in rec.events],
        "activation_bytes": stage.seq_length * B * config.hidden_size * 4,
    }


def tp_dp(layout, sharding: str, sp: bool, device: torch.device, bf16=False, config=CONFIG, micro_batches=1) -> dict:
    """STEPS SGD steps of a TP x PP x DP layout against HF on the global batch; with DDP, the parameters after
    them (this stage's)."""
    batches = synthetic_batches(config, STEPS, B, SEED)
    hf = hf_model(config, device)
    hf_optimizer = torch.optim.SGD(hf.parameters(), lr=LR)
    hf_losses = []
    for tokens in batches:
        hf_losses.append(hf_step(hf, config, tokens)[1])
        hf_optimizer.step()
    stage = build_stage(config, layout, sequence_parallel=sp, seed=SEED, device=device)
    load_hf_into_stage(stage, hf_model(config, device).state_dict())
    if sharding == "fsdp":
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        model = fully_sharded(stage, layout, mixed_precision=mp)
    else:
        model = data_parallel(stage, layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, dp_events = [], []
    dp_ranks = tuple(dist.get_process_group_ranks(layout.dp_group))
    for tokens in batches:
        rec = CollectiveRecorder()
        losses.append(
            train_step(model, optimizer, tokens, layout, num_micro_batches=micro_batches, device=device, record=rec)
        )
        dp_events = [(e.op, e.dtype) for e in rec.events if e.group_ranks == dp_ranks]
    out = {
        "losses": losses,
        "hf_losses": hf_losses,
        "dp_ops": sorted(set(dp_events)),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }
    if sharding == "ddp":
        expected = stage_state_from_master(stage, master_state_from_hf(config, hf.state_dict()))
        out["params"] = max_diff({n: p.detach() for n, p in stage.named_parameters()}, expected)
    return out


@functools.cache
def results(device: torch.device) -> dict:
    """This rank's runs at this world: 1 and 2 the unsharded model and TP stages, 4 TP x DP and TP x PP training."""
    world = dist.get_world_size()
    result: dict = {}
    if world in (1, 2):
        layout = build_layout(tp_size=world)
        if world == 1:
            result["unsharded"] = unsharded(CONFIG, device)
            result["unsharded_uneven"] = unsharded(UNEVEN, device)
        result["tp"] = tp_stage(CONFIG, layout, False, device)
        result["tp_sp"] = tp_stage(CONFIG, layout, True, device)
        result["tp_sp_uneven"] = tp_stage(UNEVEN, layout, True, device)
    else:
        layout = build_layout(tp_size=2, dp_size=world // 2)
        result["ddp"] = tp_dp(layout, "ddp", False, device)
        result["ddp_sp"] = tp_dp(layout, "ddp", True, device)
        result["fsdp_sp"] = tp_dp(layout, "fsdp", True, device)
        result["fsdp_sp_bf16"] = tp_dp(layout, "fsdp", True, device, bf16=True)
        pipeline = build_layout(tp_size=2, pp_size=world // 2)
        result["pp_sp_uneven"] = tp_dp(pipeline, "ddp", True, device, config=UNEVEN, micro_batches=2)
    return result


@on_ranks(1, devices=DEVICES)
@pytest.mark.parametrize("config", ["unsharded", "unsharded_uneven"])
def test_unsharded_llama_equals_hf_qwen2_logits_loss_and_gradients(ranks, config):
    tolerance = EXACT if ranks.device.type == "cpu" else 1e-5  # CUDA's fp32 attention kernels sum in other orders
    r = results(ranks.device)[config]
    assert r["logits"] < tolerance and r["loss"] < tolerance and r["grads"] < tolerance, r


@on_ranks(1, 2, devices=DEVICES)
@pytest.mark.parametrize("config", ["tp", "tp_sp", "tp_sp_uneven"])
def test_tp_stage_equals_hf_qwen2_logits_loss_and_gradient_shards(ranks, config):
    tolerance = EXACT if ranks.device.type == "cpu" else 1e-5  # CUDA's fp32 attention kernels sum in other orders
    run = results(ranks.device)[config]
    assert run["logits"] < tolerance and run["loss"] < tolerance and run["grads"] < tolerance, (ranks.rank, run)


def block_ops(run: dict, phase: str) -> list[tuple[str, str, int]]:
    return [(op, module, n) for op, module, ph, n in run["events"] if ph == phase and module.startswith("layers.0.")]


@on_ranks(2)
def test_llama_block_under_tp_all_reduces_once_per_row_layer_forward_and_column_layer_backward(ranks):
    run = results(ranks.device)["tp"]
    n = run["activation_bytes"]  # one [s, b, h] fp32 activation
    assert block_ops(run, "forward") == [
        ("all_reduce", "layers.0.attention.proj", n),
        ("all_reduce", "layers.0.mlp.fc2", n),
    ]
    assert block_ops(run, "backward") == [
        ("all_reduce", "layers.0.mlp.fc1", n),
        ("all_reduce", "layers.0.attention.qkv", n),
    ]


@on_ranks(2)
@pytest.mark.parametrize("config", ["tp_sp", "tp_sp_uneven"])
def test_llama_block_under_sp_gathers_before_columns_and_reduce_scatters_after_rows(ranks, config):
    """The all-reduce's two halves, on the padded sequence when TP does not divide it; backward re-gathers
    each column layer's input for its weight gradient."""
    run = results(ranks.device)[config]
    n = run["activation_bytes"]
    assert block_ops(run, "forward") == [
        ("all_gather", "layers.0.attention.qkv", n),
        ("reduce_scatter", "layers.0.attention.proj", n),
        ("all_gather", "layers.0.mlp.fc1", n),
        ("reduce_scatter", "layers.0.mlp.fc2", n),
    ]
    assert sorted(block_ops(run, "backward")) == sorted(
        [
            ("all_gather", "layers.0.mlp.fc2", n),
            ("all_gather", "layers.0.mlp.fc1", n),
            ("reduce_scatter", "layers.0.mlp.fc1", n),
            ("all_gather", "layers.0.attention.proj", n),
            ("all_gather", "layers.0.attention.qkv", n),
            ("reduce_scatter", "layers.0.attention.qkv", n),
        ]
    )


@on_ranks(2)
def test_sequence_padding_continues_positions_and_keeps_the_unpadded_loss(ranks):
    """s = 11 under SP at TP 2 runs 12 positions; the loss and gradients still equal HF's on the 11 tokens."""
    r = results(ranks.device)
    assert r["tp_sp_uneven"]["activation_bytes"] == r["tp_sp"]["activation_bytes"]  # padded to 12
    assert r["tp_sp_uneven"]["loss"] < EXACT and r["tp_sp_uneven"]["grads"] < EXACT


@on_ranks(4)
@pytest.mark.parametrize("config", ["ddp", "ddp_sp", "fsdp_sp", "pp_sp_uneven"])
def test_tp2_dp2_and_tp2_pp2_train_like_hf_qwen2_on_the_global_batch(ranks, config):
    run = results(ranks.device)[config]
    assert run["losses"] == pytest.approx(run["hf_losses"], abs=1e-5), run
    if "params" in run:
        assert run["params"] < 1e-5, run


@on_ranks(4)
def test_dp_traffic_is_bucket_all_reduces_with_ddp_and_gathers_and_reduce_scatters_with_fsdp(ranks):
    r = results(ranks.device)
    assert r["ddp"]["dp_ops"] == [("all_reduce", "float32")]
    assert r["fsdp_sp"]["dp_ops"] == [("all_gather", "float32"), ("reduce_scatter", "float32")]


@on_ranks(4)
def test_bf16_fsdp_tp_keeps_fp32_shards_and_reduce_scatters_in_fp32(ranks):
    """MixedPrecision(param_dtype=bf16, reduce_dtype=fp32): all-gathers move bf16, the gradient
    reduce-scatters fp32, the optimizer's shards stay fp32; the losses follow HF's fp32 run to bf16 accuracy."""
    run = results(ranks.device)["fsdp_sp_bf16"]
    assert run["param_dtypes"] == ["torch.float32"]
    assert run["dp_ops"] == [("all_gather", "bfloat16"), ("reduce_scatter", "float32")]
    assert run["losses"] == pytest.approx(run["hf_losses"], abs=2e-2)
    assert run["losses"] != pytest.approx(run["hf_losses"], abs=1e-6)  # it did compute in bf16

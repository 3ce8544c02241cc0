"""The "llama" style of the reference against Hugging Face transformers' own Qwen2ForCausalLM.

A third-party oracle (transformers is a test dependency, not a pinned source): a tiny Qwen2 with random
weights, loaded into the reference through reference.gpt.hf_weights. One launch of
tests/reference/workers/qwen2_oracle_worker.py per world (1, 2, 4) and device; the tests read its results.
The config: vocab 128, hidden 64, 4 query heads in 2 key/value groups, 2 layers, SwiGLU 96, b 4, s 12
(and 11, which TP 2 does not divide).
"""

from __future__ import annotations

import pytest

from tests.launch import run_worker
from tests.reference.gpus import DEVICES

LAYERS = 2
EXACT = 1e-6  # fp32, same math in a different order


def results(world: int, device: str = "cpu") -> list[dict]:
    return run_worker("qwen2_oracle_worker.py", world, device=device, timeout=420)


@pytest.mark.parametrize("config", ["unsharded", "unsharded_uneven"])
def test_unsharded_llama_equals_hf_qwen2_logits_loss_and_gradients(config):
    r = results(1)[0][config]
    assert r["logits"] < EXACT and r["loss"] < EXACT and r["grads"] < EXACT, r


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("config", ["tp", "tp_sp", "tp_sp_uneven"])
def test_tp_stage_equals_hf_qwen2_logits_loss_and_gradient_shards(config, world, device):
    tolerance = EXACT if device == "cpu" else 1e-5  # CUDA's fp32 attention kernels sum in other orders
    for rank, r in enumerate(results(world, device)):
        run = r[config]
        assert run["logits"] < tolerance and run["loss"] < tolerance and run["grads"] < tolerance, (rank, run)


def block_ops(r: dict, phase: str) -> list[tuple[str, str, int]]:
    return [
        (op, module, nbytes) for op, module, ph, nbytes in r["events"] if ph == phase and module.startswith("layers.0.")
    ]


def test_llama_block_under_tp_all_reduces_once_per_row_layer_forward_and_column_layer_backward():
    for r in results(2):
        n = r["tp"]["activation_bytes"]  # one [s, b, h] fp32 activation
        assert block_ops(r["tp"], "forward") == [
            ("all_reduce", "layers.0.attention.proj", n),
            ("all_reduce", "layers.0.mlp.fc2", n),
        ]
        assert block_ops(r["tp"], "backward") == [
            ("all_reduce", "layers.0.mlp.fc1", n),
            ("all_reduce", "layers.0.attention.qkv", n),
        ]


@pytest.mark.parametrize("config", ["tp_sp", "tp_sp_uneven"])
def test_llama_block_under_sp_gathers_before_columns_and_reduce_scatters_after_rows(config):
    """The all-reduce's two halves, on the padded sequence when TP does not divide it; backward re-gathers
    each column layer's input for its weight gradient."""
    for r in results(2):
        n = r[config]["activation_bytes"]
        assert block_ops(r[config], "forward") == [
            ("all_gather", "layers.0.attention.qkv", n),
            ("reduce_scatter", "layers.0.attention.proj", n),
            ("all_gather", "layers.0.mlp.fc1", n),
            ("reduce_scatter", "layers.0.mlp.fc2", n),
        ]
        assert sorted(block_ops(r[config], "backward")) == sorted(
            [
                ("all_gather", "layers.0.mlp.fc2", n),
                ("all_gather", "layers.0.mlp.fc1", n),
                ("reduce_scatter", "layers.0.mlp.fc1", n),
                ("all_gather", "layers.0.attention.proj", n),
                ("all_gather", "layers.0.attention.qkv", n),
                ("reduce_scatter", "layers.0.attention.qkv", n),
            ]
        )


def test_sequence_padding_continues_positions_and_keeps_the_unpadded_loss():
    """s = 11 under SP at TP 2 runs 12 positions; the loss and gradients still equal HF's on the 11 tokens."""
    for r in results(2):
        assert r["tp_sp_uneven"]["activation_bytes"] == r["tp_sp"]["activation_bytes"]  # padded to 12
        assert r["tp_sp_uneven"]["loss"] < EXACT and r["tp_sp_uneven"]["grads"] < EXACT


@pytest.mark.parametrize("config", ["ddp", "ddp_sp", "fsdp_sp", "pp_sp_uneven"])
def test_tp2_dp2_and_tp2_pp2_train_like_hf_qwen2_on_the_global_batch(config):
    for r in results(4):
        run = r[config]
        assert run["losses"] == pytest.approx(run["hf_losses"], abs=1e-5), run
        if "params" in run:
            assert run["params"] < 1e-5, run


def test_dp_traffic_is_bucket_all_reduces_with_ddp_and_gathers_and_reduce_scatters_with_fsdp():
    for r in results(4):
        assert r["ddp"]["dp_ops"] == [["all_reduce", "float32"]]
        assert r["fsdp_sp"]["dp_ops"] == [["all_gather", "float32"], ["reduce_scatter", "float32"]]


def test_bf16_fsdp_tp_keeps_fp32_shards_and_reduce_scatters_in_fp32():
    """MixedPrecision(param_dtype=bf16, reduce_dtype=fp32): all-gathers move bf16, the gradient
    reduce-scatters fp32, the optimizer's shards stay fp32; the losses follow HF's fp32 run to bf16 accuracy."""
    for r in results(4):
        run = r["fsdp_sp_bf16"]
        assert run["param_dtypes"] == ["torch.float32"]
        assert run["dp_ops"] == [["all_gather", "bfloat16"], ["reduce_scatter", "float32"]]
        assert run["losses"] == pytest.approx(run["hf_losses"], abs=2e-2)
        assert run["losses"] != pytest.approx(run["hf_losses"], abs=1e-6)  # it did compute in bf16

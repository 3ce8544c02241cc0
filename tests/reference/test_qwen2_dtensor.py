"""The Tensor Parallelism Knowledge Compilation's recipe on Hugging Face's own `Qwen2ForCausalLM` (transformers
5.23.0, tiny config, random weights), run under torchrun with PyTorch DTensor at the pin.

workers/qwen2_dtensor_worker.py runs once per (mode, device), in its world's shared launch: `tp` at world 2 (the
TP plan, the sequence-parallel plan, HF's shipped plan, the pitfalls' observations and fixes), `fsdp_tp` at world
4 (FSDP2 on a dp 2 x tp 2 mesh with checkpointed layers, fp32 and bf16 compute); `uneven` at world 2 (pitfall 2,
which crashes) is a launch of its own. Every test asserts on one shared launch. The expected collective counts
are data (PER_BLOCK, per_step); test_qwen2_reference_vs_dtensor.py compares the measured ones with the
reference decoder's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.launch import run_worker, torchrun_failing
from tests.reference.gpus import DEVICES

WORKER = Path(__file__).parent / "workers" / "qwen2_dtensor_worker.py"
LAYERS = 2  # tiny_config(): 2 decoder layers, hidden 32, 4 query heads, 2 KV heads, vocab 64
FP32 = 2e-6  # observed: loss <= 4.8e-7, gradients <= 4.5e-8 (fp32 sums in another order)
BF16_LOSS, BF16_GRAD = 5e-2, 5e-3  # bf16 compute, fp32 reduction: observed 2.2e-2 (loss ~4.2), 1.0e-3

# Collectives one decoder layer issues in one step, as CommDebugMode attributes them (TP 2, no FSDP).
PER_BLOCK = {
    # forward: 1 all-reduce after attention (o_proj), 1 after the MLP (down_proj), as Megatron's
    # _ReduceFromTensorModelParallelRegion. Backward: one per column-parallel linear (q, k, v, gate, up), because
    # each ColwiseParallel wraps its own plain input as a Replicate DTensor whose gradient is Partial; Megatron
    # (one fused qkv and one fc1, one _CopyToModelParallelRegion each) issues 2.
    "tp": {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 5}},
    # sequence parallel: Shard(1) -> Replicate before attention and before the MLP (all-gather), Partial ->
    # Shard(1) after o_proj and down_proj (reduce-scatter); backward mirrors it. q, k, v share one gathered
    # DTensor, so their input gradients are summed before the one reduce-scatter.
    "sp": {"forward": {"all_gather": 2, "reduce_scatter": 2}, "backward": {"all_gather": 2, "reduce_scatter": 2}},
}
PER_BLOCK["hf"] = PER_BLOCK["tp"]  # HF's shipped plan is the same block plan (colwise/rowwise, no SP)


def per_step(config: str, layers: int = LAYERS) -> dict:
    """Collectives of one whole step (forward, backward) at TP 2, in the number of decoder layers."""
    if config == "tp":  # embedding all-reduce, blocks, loss_parallel's 3 all-reduces (max, sum of exp, target)
        return {
            "forward": {"all_reduce": 1 + 2 * layers + 3},
            "backward": {"all_reduce": 5 * layers + 1},
        }  # + the head's input gradient
    if config == "sp":  # embedding reduce-scatter, blocks, the head's all-gather, loss_parallel
        return {
            "forward": {"all_gather": 2 * layers + 1, "all_reduce": 3, "reduce_scatter": 2 * layers + 1},
            # blocks, the embedding's and the head's mirrors, and 2 of each CommDebugMode attributes to the
            # final norm (measured, the same at 1, 2 and 3 layers)
            "backward": {"all_gather": 2 * layers + 3, "reduce_scatter": 2 * layers + 3},
        }
    if config == "hf":  # embedding, blocks, colwise_gather_output's all-gather of the logits; plain loss
        return {"forward": {"all_gather": 1, "all_reduce": 1 + 2 * layers}, "backward": {"all_reduce": 5 * layers + 1}}
    raise ValueError(config)


def results(mode: str, device: str = "cpu") -> list[dict]:
    world = 4 if mode == "fsdp_tp" else 2
    return run_worker("qwen2_dtensor_worker.py", world, device=device, timeout=420)


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", ["tp", "sp", "hf"])
def test_plan_gives_the_unsharded_hf_models_loss_and_gradients(config, device):
    for rank in results("tp", device):
        assert rank[config]["loss_diff"] <= FP32 and rank[config]["grad_diff"] <= FP32, (rank["rank"], rank[config])


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
def test_document_head_keeps_vocab_sharded_dtensor_logits_and_hf_head_gathers_them(device):
    for rank in results("tp", device):
        for config in ("tp", "sp"):  # ColwiseParallel(use_local_output=False): a DTensor, half the vocab here
            assert rank[config]["logits"] == {"dtensor": True, "local_shape": [4, 8, 32]}
        assert rank["hf"]["logits"] == {"dtensor": False, "local_shape": [4, 8, 64]}  # colwise_gather_output


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", ["tp", "sp", "hf"])
def test_collectives_per_block_follow_the_closed_form(config, device):
    for rank in results("tp", device):
        assert rank[config]["blocks"] == [PER_BLOCK[config]] * LAYERS


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", ["tp", "sp", "hf"])
def test_collectives_per_step_follow_the_closed_form(config, device):
    for rank in results("tp", device):
        assert rank[config]["step"] == per_step(config)


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
def test_sequence_parallel_leaves_norm_weight_gradients_partial_after_backward(device):
    """SequenceParallel's norm weights are Replicate; each rank's gradient covers its tokens only, and DTensor
    leaves the sum to whoever reads it next (Megatron all-reduces them in finalize_model_grads)."""
    norms = [
        f"model.layers.{i}.{norm}.weight"
        for i in range(LAYERS)
        for norm in ("input_layernorm", "post_attention_layernorm")
    ] + ["model.norm.weight"]
    for rank in results("tp", device):
        assert rank["sp"]["partial_grads"] == sorted(norms)
        assert rank["tp"]["partial_grads"] == rank["hf"]["partial_grads"] == []


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_reduces_the_partial_norm_gradients_and_gathers_each_layer_once_per_forward(device):
    for rank in results("fsdp_tp", device):
        for config in ("fp32", "bf16"):
            run = rank[config]
            assert run["partial_grads"] == []
            # one all-reduce over tp per sequence-parallel norm (2 per layer, 1 final) before FSDP reduces
            assert run["step"]["backward"]["all_reduce"] == 2 * LAYERS + 1
            assert [block["backward"]["all_reduce"] for block in run["blocks"]] == [2] * LAYERS
            # forward: the SP block's 2 all-gathers and 2 reduce-scatters over tp, and FSDP's all-gather of
            # the layer's shards over dp
            assert [block["forward"] for block in run["blocks"]] == [{"all_gather": 3, "reduce_scatter": 2}] * LAYERS


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_on_a_2d_mesh_with_checkpointing_in_fp32_gives_the_unsharded_loss_and_gradients(device):
    for rank in results("fsdp_tp", device):
        assert rank["fp32"]["loss_diff"] <= FP32 and rank["fp32"]["grad_diff"] <= FP32, rank["rank"]


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_bf16_compute_stays_within_bound_and_keeps_fp32_gradients(device):
    for rank in results("fsdp_tp", device):
        bf16 = rank["bf16"]
        assert bf16["loss_diff"] <= BF16_LOSS and bf16["grad_diff"] <= BF16_GRAD, (rank["rank"], bf16)
        assert bf16["grad_diff"] > rank["fp32"]["grad_diff"]  # the bf16 run really computed in bf16
        assert bf16["grad_dtypes"] == ["torch.float32"]  # sharded fp32 parameters, gradients reduced in fp32


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
def test_pitfall_positional_layouts_on_a_keyword_call_then_keyword_layouts(device):
    for rank in results("tp", device):
        assert (
            rank["pitfall_positional"]["error"]
            == "ValueError: module inputs and input_layouts should have same length!"
        )
        assert rank["sp"]["loss_diff"] <= FP32  # the fix: input_kwarg_layouts={"hidden_states": Shard(1)}


@pytest.mark.upstream("pytorch")
def test_pitfall_sequence_not_divisible_by_tp_aborts_the_job_under_sequence_parallelism():
    """7 tokens at TP 2: the embedding's reduce-scatter leaves 4 and 3 tokens, the next SequenceParallel takes
    its local tensor as an even shard, and the all-gather's sizes disagree; gloo aborts the job (on CPU)."""
    output, _ = torchrun_failing(WORKER, 2, tempfile.mkdtemp(prefix="qwen2-uneven-"), "uneven", timeout=240)
    assert "Received data size doesn't match expected size" in output
    assert "ran under SP" not in output


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
def test_pitfall_fix_padding_to_a_multiple_of_tp_gives_the_unpadded_loss(device):
    for rank in results("tp", device):
        fix = rank["pitfall_uneven_fix"]
        assert (fix["seq"], fix["padded_seq"]) == (7, 8)
        assert fix["loss_diff"] <= FP32 and fix["grad_diff"] <= FP32


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
def test_pitfall_collective_on_a_dtensor_loss_then_on_its_local_tensor(device):
    for rank in results("tp", device):
        pitfall = rank["pitfall_dtensor_loss"]
        assert (pitfall["loss_type"], pitfall["placements"]) == ("DTensor", ["R"])
        # at the pin the error is DTensor's dispatch refusing the c10d op, not the document's
        # "found no DeviceMesh from dtensor args"
        assert (
            pitfall["error"]
            == "NotImplementedError: Operator c10d.allreduce_.default does not have a sharding strategy registered."
        )
        assert pitfall["fixed_mean_diff"] == 0.0  # all_reduce(loss.to_local()) / world: the replicated loss


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
def test_sequence_parallel_plan_needs_sdpa_attention_on_hf_qwen2(device):
    """With eager attention the causal mask is built for the local sequence shard (4 of 8 tokens) and added to
    the gathered sequence's scores; the plans above run with SDPA, which takes no mask here."""
    for rank in results("tp", device):
        assert (
            rank["eager_mask"]["error"]
            == "RuntimeError: The size of tensor a (8) must match the size of tensor b (4) at non-singleton dimension 3"
        )


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("device", DEVICES)
def test_sequence_parallel_plan_needs_positions_passed_in(device):
    """HF derives default positions from the embedding's output, under SP this rank's 4 tokens: rotary cos/sin
    for 4 positions meet 8-token queries. The plans above pass position_ids (as the document pads them)."""
    for rank in results("tp", device):
        assert (
            rank["positions_missing"]["error"]
            == "RuntimeError: The size of tensor a (8) must match the size of tensor b (4) at non-singleton dimension 2"
        )

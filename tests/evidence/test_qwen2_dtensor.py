"""The Tensor Parallelism Knowledge Compilation's recipe on Hugging Face's own `Qwen2ForCausalLM` (transformers
5.23.0, tiny config, random weights; reference/hf_tp/plan.py) with PyTorch DTensor at the pin, against the
unsharded HF model. The first test at a world runs what it checks, once a rank: at 2 (`run_tp()`) the TP plan,
the sequence-parallel plan, HF's shipped plan, the pitfalls' observations and fixes; at 4 (`run_fsdp_tp()`)
FSDP2 on a dp 2 x tp 2 mesh with checkpointed layers, fp32 and bf16 compute. Pitfall 2, which crashes, is a
launch of its own (this file run as a script). Each run keeps loss and gradient differences and the collectives
`CommDebugMode` counted per decoder layer and per step; the expected counts are data (PER_BLOCK, per_step),
and test_qwen2_reference_vs_dtensor.py compares them with the reference decoder's.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import PrepareModuleInput, loss_parallel, parallelize_module

from reference.distributed import distributed
from reference.hf_tp import plan as qwen2
from tests.launch import torchrun_failing
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES
from tests.reference.helpers import max_diff

pytestmark = pytest.mark.upstream("pytorch")

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


SEED, DATA_SEED, BATCH, SEQ = 0, 1, 4, 8
# CommDebugMode's op names (functional collectives from DTensor, c10d ops from FSDP2) -> the collective's kind
OP_NAMES = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "allreduce_": "all_reduce",
}


def batch(device: torch.device, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, next-token labels, positions), the same on every rank."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    ids = torch.randint(0, qwen2.tiny_config().vocab_size, (BATCH, seq), generator=generator)
    return ids.to(device), qwen2.shift_labels(ids).to(device), torch.arange(seq, device=device).unsqueeze(0)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient under its HF name (DTensor shards gathered, checkpoint wrapper removed)."""
    return {
        name.replace("_checkpoint_wrapped_module.", ""): (
            p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        ).float()
        for name, p in model.named_parameters()
    }


def partial_grads(model: torch.nn.Module) -> list[str]:
    """Parameters whose gradient is still an unreduced Partial sum after backward (left for a later reduction)."""
    return sorted(
        name.replace("_checkpoint_wrapped_module.", "")
        for name, p in model.named_parameters()
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)
    )


def counts(comm: CommDebugMode, fqn: str) -> dict[str, dict[str, int]]:
    """{phase: {collective: count}} that `comm` attributed to module `fqn` ("Global" for the whole step)."""
    per_phase, result = comm.comm_module_counts.get(fqn, {}), {}
    for phase in ("forward", "backward"):
        tally = Counter()
        for op, n in per_phase.get(phase, {}).items():
            tally[OP_NAMES.get(op.__name__, op.__name__)] += n
        result[phase] = dict(sorted(tally.items()))
    return result


def step_record(model, oracle_loss, oracle_grads, ids, labels, positions, dp_group=None) -> dict:
    """One forward/backward of `model` under CommDebugMode, compared with the unsharded oracle."""
    with CommDebugMode() as comm:
        loss = qwen2.loss_and_backward(model, ids, labels, positions)
    if dp_group is not None:  # data parallel: the oracle's loss is the mean over the DP ranks' batches
        dist.all_reduce(loss, group=dp_group)
        loss /= dp_group.size()
    layers = len(model.model.layers)
    return {
        "loss_diff": (loss.float() - oracle_loss).abs().item(),
        "grad_diff": max_diff(full_grads(model), oracle_grads),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
        "partial_grads": partial_grads(model),
        "step": counts(comm, "Global"),
        "blocks": [counts(comm, f"{type(model).__name__}.model.layers.{i}") for i in range(layers)],
    }


def oracle(base, ids, labels, positions) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = copy.deepcopy(base)
    return qwen2.loss_and_backward(model, ids, labels, positions), full_grads(model)


def error_of(action) -> str:
    """'ExceptionType: message' of what `action()` raises (the test asserts it raised)."""
    try:
        action()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@functools.cache
def run_tp(device: torch.device) -> dict:
    """This rank's runs at world 2: the three plans, the pitfalls and what else the SP plan needs."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    base = qwen2.build(qwen2.tiny_config(), SEED).to(device)
    ids, labels, positions = batch(device)
    oracle_loss, oracle_grads = oracle(base, ids, labels, positions)
    result = {}
    for config, apply in (
        ("tp", lambda m: qwen2.document_plan(m, mesh, sequence_parallel=False)),
        ("sp", lambda m: qwen2.document_plan(m, mesh, sequence_parallel=True)),
        ("hf", lambda m: qwen2.hf_plan(m, mesh)),
    ):
        model = apply(copy.deepcopy(base))
        result[config] = step_record(model, oracle_loss, oracle_grads, ids, labels, positions)
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=positions).logits
        result[config]["logits"] = {
            "dtensor": isinstance(logits, DTensor),
            "local_shape": list((logits.to_local() if isinstance(logits, DTensor) else logits).shape),
        }
    result["pitfall_positional"] = pitfall_positional(base, mesh, ids, positions)
    result["pitfall_uneven_fix"] = pitfall_uneven_fix(base, mesh, device)
    result["pitfall_dtensor_loss"] = pitfall_dtensor_loss(base, mesh, ids, labels, positions)
    result["eager_mask"] = eager_mask(mesh, device, ids, positions)
    sp_model = qwen2.document_plan(copy.deepcopy(base), mesh, sequence_parallel=True)
    result["positions_missing"] = {"error": error_of(lambda: sp_model(input_ids=ids))}  # HF derives them locally
    return result


def pitfall_positional(base, mesh, ids, positions) -> dict:
    """Pitfall 1: attention's input layout given positionally, while the decoder layer passes hidden_states=..."""
    plan = qwen2.block_plan(sequence_parallel=True)
    plan["self_attn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    model = copy.deepcopy(base)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    parallelize_module(model, mesh, qwen2.top_plan(sequence_parallel=True))
    return {"error": error_of(lambda: model(input_ids=ids, position_ids=positions))}


def eager_mask(mesh, device, ids, positions) -> dict:
    """Not in the document: under the SP plan, HF builds the causal mask from the embedding's output, which is
    this rank's sequence shard; eager attention adds that mask to full-sequence scores, SDPA needs none."""
    model = qwen2.build(qwen2.tiny_config(attn_implementation="eager"), SEED).to(device)
    qwen2.document_plan(model, mesh, sequence_parallel=True)
    return {"error": error_of(lambda: model(input_ids=ids, position_ids=positions))}


def pitfall_uneven_fix(base, mesh, device) -> dict:
    """Pitfall 2's fix: a 7-token sequence padded to 8 (labels ignored, positions continued) under SP gives the
    unpadded unsharded model's loss and gradients."""
    ids, labels, positions = batch(device, seq=SEQ - 1)
    oracle_loss, oracle_grads = oracle(base, ids, labels, positions)
    tp = mesh.size()
    padded = (
        qwen2.pad_to_multiple(ids, tp, 0),
        qwen2.pad_to_multiple(labels, tp, qwen2.IGNORE_INDEX),
        torch.arange(qwen2.pad_to_multiple(ids, tp, 0).size(1), device=device).unsqueeze(0),
    )
    model = qwen2.document_plan(copy.deepcopy(base), mesh, sequence_parallel=True)
    record = step_record(model, oracle_loss, oracle_grads, *padded)
    return {
        "seq": ids.size(1),
        "padded_seq": padded[0].size(1),
        "loss_diff": record["loss_diff"],
        "grad_diff": record["grad_diff"],
    }


def pitfall_dtensor_loss(base, mesh, ids, labels, positions) -> dict:
    """Pitfall 3: `dist.all_reduce` of the loss `loss_parallel` returns (a DTensor), then the fix: reduce its
    local tensor."""
    model = qwen2.document_plan(copy.deepcopy(base), mesh, sequence_parallel=False)
    logits = model(input_ids=ids, position_ids=positions).logits
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=qwen2.IGNORE_INDEX)
    error = error_of(lambda: dist.all_reduce(loss))
    local = loss.to_local().detach().clone()
    dist.all_reduce(local)
    return {
        "loss_type": type(loss).__name__,
        "placements": [str(p) for p in loss.placements],
        "error": error,
        "fixed_mean_diff": (local / dist.get_world_size() - loss.to_local()).abs().item(),
    }


@functools.cache
def run_fsdp_tp(device: torch.device) -> dict:
    """The document's working configuration on dp 2 x tp 2; each DP rank trains on its half of the batch."""
    mesh = init_device_mesh(device.type, (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    base = qwen2.build(qwen2.tiny_config(), SEED).to(device)
    ids, labels, positions = batch(device)
    oracle_loss, oracle_grads = oracle(base, ids, labels, positions)
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    mine = [t.chunk(2)[dp_rank] for t in (ids, labels)]
    result = {}
    for config, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = qwen2.fsdp2_2d(copy.deepcopy(base), mesh, sequence_parallel=True, param_dtype=dtype)
        result[config] = step_record(model, oracle_loss, oracle_grads, *mine, positions, dp_group=dp_group)
    return result


def run_uneven(device: torch.device) -> None:
    """Pitfall 2: a 7-token sequence under the SP plan at TP 2 (no padding); gloo aborts the job."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = qwen2.document_plan(qwen2.build(qwen2.tiny_config(), SEED).to(device), mesh, sequence_parallel=True)
    ids, labels, positions = batch(device, seq=SEQ - 1)
    qwen2.loss_and_backward(model, ids, labels, positions)
    print(f"rank {dist.get_rank()}: a {SEQ - 1}-token sequence ran under SP at TP {mesh.size()}", flush=True)


@on_ranks(2, devices=DEVICES)
@pytest.mark.parametrize("config", ["tp", "sp", "hf"])
def test_plan_gives_the_unsharded_hf_models_loss_and_gradients(ranks, config):
    runs = run_tp(ranks.device)
    assert runs[config]["loss_diff"] <= FP32 and runs[config]["grad_diff"] <= FP32, (ranks.rank, runs[config])


@on_ranks(2, devices=DEVICES)
def test_document_head_keeps_vocab_sharded_dtensor_logits_and_hf_head_gathers_them(ranks):
    runs = run_tp(ranks.device)
    for config in ("tp", "sp"):  # ColwiseParallel(use_local_output=False): a DTensor, half the vocab here
        assert runs[config]["logits"] == {"dtensor": True, "local_shape": [4, 8, 32]}
    assert runs["hf"]["logits"] == {"dtensor": False, "local_shape": [4, 8, 64]}  # colwise_gather_output


@on_ranks(2, devices=DEVICES)
@pytest.mark.parametrize("config", ["tp", "sp", "hf"])
def test_collectives_per_block_follow_the_closed_form(ranks, config):
    runs = run_tp(ranks.device)
    assert runs[config]["blocks"] == [PER_BLOCK[config]] * LAYERS


@on_ranks(2, devices=DEVICES)
@pytest.mark.parametrize("config", ["tp", "sp", "hf"])
def test_collectives_per_step_follow_the_closed_form(ranks, config):
    runs = run_tp(ranks.device)
    assert runs[config]["step"] == per_step(config)


@on_ranks(2, devices=DEVICES)
def test_sequence_parallel_leaves_norm_weight_gradients_partial_after_backward(ranks):
    """SequenceParallel's norm weights are Replicate; each rank's gradient covers its tokens only, and DTensor
    leaves the sum to whoever reads it next (Megatron all-reduces them in finalize_model_grads)."""
    norms = [
        f"model.layers.{i}.{norm}.weight"
        for i in range(LAYERS)
        for norm in ("input_layernorm", "post_attention_layernorm")
    ] + ["model.norm.weight"]
    runs = run_tp(ranks.device)
    assert runs["sp"]["partial_grads"] == sorted(norms)
    assert runs["tp"]["partial_grads"] == runs["hf"]["partial_grads"] == []


@on_ranks(4, devices=DEVICES)
def test_fsdp2_reduces_the_partial_norm_gradients_and_gathers_each_layer_once_per_forward(ranks):
    runs = run_fsdp_tp(ranks.device)
    for config in ("fp32", "bf16"):
        run = runs[config]
        assert run["partial_grads"] == []
        # one all-reduce over tp per sequence-parallel norm (2 per layer, 1 final) before FSDP reduces
        assert run["step"]["backward"]["all_reduce"] == 2 * LAYERS + 1
        assert [block["backward"]["all_reduce"] for block in run["blocks"]] == [2] * LAYERS
        # forward: the SP block's 2 all-gathers and 2 reduce-scatters over tp, and FSDP's all-gather of
        # the layer's shards over dp
        assert [block["forward"] for block in run["blocks"]] == [{"all_gather": 3, "reduce_scatter": 2}] * LAYERS


@on_ranks(4, devices=DEVICES)
def test_fsdp2_on_a_2d_mesh_with_checkpointing_in_fp32_gives_the_unsharded_loss_and_gradients(ranks):
    runs = run_fsdp_tp(ranks.device)
    assert runs["fp32"]["loss_diff"] <= FP32 and runs["fp32"]["grad_diff"] <= FP32, ranks.rank


@on_ranks(4, devices=DEVICES)
def test_fsdp2_bf16_compute_stays_within_bound_and_keeps_fp32_gradients(ranks):
    runs = run_fsdp_tp(ranks.device)
    bf16 = runs["bf16"]
    assert bf16["loss_diff"] <= BF16_LOSS and bf16["grad_diff"] <= BF16_GRAD, (ranks.rank, bf16)
    assert bf16["grad_diff"] > runs["fp32"]["grad_diff"]  # the bf16 run really computed in bf16
    assert bf16["grad_dtypes"] == ["torch.float32"]  # sharded fp32 parameters, gradients reduced in fp32


@on_ranks(2, devices=DEVICES)
def test_pitfall_positional_layouts_on_a_keyword_call_then_keyword_layouts(ranks):
    runs = run_tp(ranks.device)
    assert runs["pitfall_positional"]["error"] == "ValueError: module inputs and input_layouts should have same length!"
    assert runs["sp"]["loss_diff"] <= FP32  # the fix: input_kwarg_layouts={"hidden_states": Shard(1)}


@on_ranks(2)
def test_keyword_layouts_need_their_desired_layouts_and_no_positional_ones(ranks):
    """The fix to pitfall 1, part by part, on a module called as HF calls self_attn(hidden_states=...):
    input_kwarg_layouts alone fails the constructor's assertion; with positional input_layouts too, the keyword
    hook still checks the (empty) positional inputs against them; with its desired layouts and input_layouts
    left None, the keyword input arrives gathered, Replicate. The constructor compares only the two dicts'
    lengths, and only when input_kwarg_layouts is given: desired layouts alone, or for another keyword, pass it."""

    class Attention(torch.nn.Module):
        def forward(self, hidden_states):
            return hidden_states

    mesh = init_device_mesh(torch.device(ranks.device).type, (ranks.world,))
    shard = {"hidden_states": Shard(1)}
    gathered = {"hidden_states": Replicate()}
    with pytest.raises(AssertionError, match="input_kwarg_layouts and desired_input_kwarg_layouts should have same"):
        PrepareModuleInput(input_kwarg_layouts=shard)
    x = torch.arange(2.0 * ranks.world * 3, device=ranks.device).reshape(2, ranks.world, 3)
    local = x[:, ranks.rank : ranks.rank + 1]
    both = PrepareModuleInput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        input_kwarg_layouts=shard,
        desired_input_kwarg_layouts=gathered,
    )
    with pytest.raises(ValueError, match="module inputs and input_layouts should have same length!"):
        parallelize_module(Attention(), mesh, both)(hidden_states=local)
    keyword = PrepareModuleInput(input_kwarg_layouts=shard, desired_input_kwarg_layouts=gathered)
    out = parallelize_module(Attention(), mesh, keyword)(hidden_states=local)
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    assert torch.equal(out.to_local(), x)
    desired_only = PrepareModuleInput(desired_input_kwarg_layouts=gathered)  # accepted, then ignored
    out = parallelize_module(Attention(), mesh, desired_only)(hidden_states=local)
    assert not isinstance(out, DTensor) and torch.equal(out, local)
    PrepareModuleInput(input_kwarg_layouts=shard, desired_input_kwarg_layouts={"position_ids": Replicate()})


def test_pitfall_sequence_not_divisible_by_tp_aborts_the_job_under_sequence_parallelism():
    """7 tokens at TP 2: the embedding's reduce-scatter leaves 4 and 3 tokens, the next SequenceParallel takes
    its local tensor as an even shard, and the all-gather's sizes disagree; gloo aborts the job (on CPU)."""
    output, _ = torchrun_failing(Path(__file__), 2, "uneven", timeout=240)
    assert "Received data size doesn't match expected size" in output
    assert "ran under SP" not in output


@on_ranks(2, devices=DEVICES)
def test_pitfall_fix_padding_to_a_multiple_of_tp_gives_the_unpadded_loss(ranks):
    runs = run_tp(ranks.device)
    fix = runs["pitfall_uneven_fix"]
    assert (fix["seq"], fix["padded_seq"]) == (7, 8)
    assert fix["loss_diff"] <= FP32 and fix["grad_diff"] <= FP32


@on_ranks(2, devices=DEVICES)
def test_pitfall_collective_on_a_dtensor_loss_then_on_its_local_tensor(ranks):
    runs = run_tp(ranks.device)
    pitfall = runs["pitfall_dtensor_loss"]
    assert (pitfall["loss_type"], pitfall["placements"]) == ("DTensor", ["R"])
    # at the pin the error is DTensor's dispatch refusing the c10d op, not the document's
    # "found no DeviceMesh from dtensor args"
    assert (
        pitfall["error"]
        == "NotImplementedError: Operator c10d.allreduce_.default does not have a sharding strategy registered."
    )
    assert pitfall["fixed_mean_diff"] == 0.0  # all_reduce(loss.to_local()) / world: the replicated loss


@on_ranks(2, devices=DEVICES)
def test_sequence_parallel_plan_needs_sdpa_attention_on_hf_qwen2(ranks):
    """With eager attention the causal mask is built for the local sequence shard (4 of 8 tokens) and added to
    the gathered sequence's scores; the plans above run with SDPA, which takes no mask here."""
    runs = run_tp(ranks.device)
    assert (
        runs["eager_mask"]["error"]
        == "RuntimeError: The size of tensor a (8) must match the size of tensor b (4) at non-singleton dimension 3"
    )


@on_ranks(2, devices=DEVICES)
def test_sequence_parallel_plan_needs_positions_passed_in(ranks):
    """HF derives default positions from the embedding's output, under SP this rank's 4 tokens: rotary cos/sin
    for 4 positions meet 8-token queries. The plans above pass position_ids (as the document pads them)."""
    runs = run_tp(ranks.device)
    assert (
        runs["positions_missing"]["error"]
        == "RuntimeError: The size of tensor a (8) must match the size of tensor b (4) at non-singleton dimension 2"
    )


if __name__ == "__main__":  # the pitfall-2 launch: a short collective timeout, so a survivor does not wait long
    with distributed("cpu", timeout_s=30) as device:
        run_uneven(device)

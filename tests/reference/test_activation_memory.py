"""The bytes one reference block, GPT-2 or Llama, saves for backward (counted with saved_tensors_hooks, bf16,
CPU) in each configuration of Korthikanti et al. 2022 Table 2, term by term, with the reason for every
difference: from the paper's terms for GPT-2, from the closed form derived in llama_block.py for Llama. At world
2 the first test to ask counts both blocks (`counts()`, once a rank) and megatron-core's own TransformerLayer
(`megatron_counts()`); each test asserts on its rank's counts."""

import contextlib
import dataclasses
import functools
import io
import json

import pytest
import torch
import torch.distributed as dist

from reference.measure.activation_memory import measure
from reference.measure.activation_memory.counting import SavedTensor, SavedTensorCounter
from reference.measure.activation_memory.llama_block import LlamaSetting, classify
from reference.measure.activation_memory.paper import CONFIGURATIONS
from reference.measure.torch_patches import cuda_calls_on_cpu
from tests.launch import ROOT
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES
from tests.reference.helpers import every_rank, megatron_parallel_state

S, B, H, A, T = 32, 2, 64, 4, 2  # COUNT_SHAPE, at world 2
SBH, AS2B = S * B * H, A * S * S * B
K, F = 2, 160  # LLAMA_COUNT_SHAPE: key/value heads, SwiGLU size
SB, SD = S * B, S * H // A
COUNT_SHAPE = dict(s=S, b=B, h=H, a=A)  # s != h / a, so the s^2 tensors are told apart by shape
LLAMA_COUNT_SHAPE = dict(COUNT_SHAPE, k=K, f=F)  # k < a (grouped-query), f not 4h: both show in the bytes
FP32_ATTENTION = "CPU SDPA math path computes bf16 attention in fp32: 4-byte copies instead of 2"
TRACE = ROOT / "reading_notes" / "traces" / "activation_memory.json"


def memory_counts(model: str, shape: dict) -> list[dict]:
    """Table 2's configurations that fit this world, counted on rank-local blocks."""
    world, device = dist.get_world_size(), torch.device("cpu")
    if world == 1:
        return [measure.count(model, "no parallelism", shape, tp_group=dist.group.WORLD, device=device).to_dict()]
    single = [dist.new_group([r]) for r in range(world)][dist.get_rank()]  # every rank creates every group
    groups = {1: single, world: dist.group.WORLD}
    return [c.to_dict() for c in measure.count_all(model, shape, tp_groups=groups, device=device)]


@functools.cache
def counts(model: str = "gpt2") -> list[dict]:
    """This rank's count of every configuration this world allows, for the GPT-2 or the Llama block."""
    return memory_counts(model, COUNT_SHAPE if model == "gpt2" else LLAMA_COUNT_SHAPE)


def _counts() -> dict[str, dict]:
    return {c["configuration"]: c for c in counts()}


def _table(configuration: str) -> list[tuple]:
    return [(r["term"], r["paper_bytes"], r["measured_bytes"], r["reason"]) for r in _counts()[configuration]["rows"]]


@on_ranks(2)
def test_every_configuration_of_table2_is_counted_on_every_rank(ranks):
    assert [c["configuration"] for c in counts()] == list(CONFIGURATIONS)
    first, second = every_rank(counts())
    assert first == second  # same shapes on both TP ranks


@on_ranks(2)
@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_the_paper_column_sums_to_table2(ranks, configuration):
    count = _counts()[configuration]
    assert sum(r["paper_bytes"] for r in count["rows"]) == count["table2_bytes"]


@on_ranks(2)
@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_every_counted_byte_is_in_a_row_and_every_row_is_explained(ranks, configuration):
    count = _counts()[configuration]
    assert sum(r["measured_bytes"] for r in count["rows"]) == count["counted_bytes"]
    for row in count["rows"]:
        assert row["measured_bytes"] == row["expected_bytes"], row


@on_ranks(2)
def test_table2_closed_forms(ranks):
    """sbh(34 + 5as/h); sbh(10 + 24/t + 5as/(ht)); sbh(34/t + 5as/(ht)); sbh(34/t); 2sbh, for s 32, b 2,
    h 64, a 4, t 2."""
    assert {name: c["table2_bytes"] for name, c in _counts().items()} == {
        "no parallelism": 34 * SBH + 5 * AS2B,
        "tensor parallel": 10 * SBH + 24 * SBH // T + 5 * AS2B // T,
        "tensor + sequence parallel": 34 * SBH // T + 5 * AS2B // T,
        "tensor + sequence parallel + selective recompute": 34 * SBH // T,
        "full recompute": 2 * SBH,
    }


@on_ranks(2)
def test_no_parallelism_term_by_term(ranks):
    """(paper term, paper bytes, counted bytes, reason): the reference keeps 90,624 bytes more than the
    paper's 180,224, all of it fp32 attention, dropout noise instead of 1-byte masks and LayerNorm stats."""
    noise_fp32 = "CPU dropout saves an fp32 noise tensor (4 bytes/element), not a 1-byte mask"
    noise_bf16 = "CPU dropout saves a bf16 noise tensor (2 bytes/element), not a 1-byte mask"
    assert _table("no parallelism") == [
        ("LayerNorm inputs, 2 x 2sbh", 4 * SBH, 4 * SBH, "same"),
        ("QKV projection input, 2sbh", 2 * SBH, 2 * SBH, "same"),
        ("Q and K for QK^T, 4sbh", 4 * SBH, 8 * SBH, FP32_ATTENTION + " (scaled Q and K^T)"),
        ("softmax output, 2as^2b", 2 * AS2B, 4 * AS2B, FP32_ATTENTION),
        ("softmax dropout mask, as^2b", AS2B, 4 * AS2B, noise_fp32),
        ("softmax dropout output (for x V), 2as^2b", 2 * AS2B, 4 * AS2B, FP32_ATTENTION),
        ("V for attention over values, 2sbh", 2 * SBH, 4 * SBH, FP32_ATTENTION),
        ("output projection input, 2sbh", 2 * SBH, 2 * SBH, "same"),
        ("attention and MLP dropout masks, 2 x sbh", 2 * SBH, 4 * SBH, noise_bf16),
        ("MLP first linear input, 2sbh", 2 * SBH, 2 * SBH, "same"),
        ("GeLU input, 8sbh", 8 * SBH, 8 * SBH, "same"),
        ("MLP second linear input, 8sbh", 8 * SBH, 8 * SBH, "same: the GeLU output, saved by the second linear layer"),
        (
            "LayerNorm mean and rstd, 2 LayerNorms x 2 x sb; not counted by the paper (O(sb))",
            0,
            2 * 2 * S * B * 2,
            "torch's LayerNorm keeps them for backward; bf16 on CPU",
        ),
    ]
    assert _counts()["no parallelism"]["counted_bytes"] - _counts()["no parallelism"]["table2_bytes"] == 90_624


@on_ranks(2)
def test_sequence_parallelism_splits_the_ten_replicated_sbh(ranks):
    """TP leaves LayerNorm inputs, the column layers' inputs and the dropout masks (the paper's 10sbh; the
    reference's 12sbh with bf16 noise, plus the LayerNorm statistics) whole on every rank; SP splits them."""
    tp, sp = (_counts()[c]["counted_bytes"] for c in ("tensor parallel", "tensor + sequence parallel"))
    assert tp - sp == (12 * SBH + 8 * S * B) // T


@on_ranks(2)
def test_selective_recompute_drops_exactly_the_attention_core(ranks):
    """Selective keeps the fused QKV output (bf16, 6sbh/t) for the core, instead of fp32 Q, K^T, V (12sbh/t)
    and the three s^2 tensors (12as^2b/t in fp32; the paper's 5as^2b/t)."""
    sp, selective = (
        _counts()[c]["counted_bytes"]
        for c in ("tensor + sequence parallel", "tensor + sequence parallel + selective recompute")
    )
    assert sp - selective == (12 * SBH + 12 * AS2B - 6 * SBH) // T


@on_ranks(2)
def test_full_recompute_keeps_only_the_layer_input(ranks):
    count = _counts()["full recompute"]
    assert count["counted_bytes"] == count["table2_bytes"] == 2 * SBH
    assert [r["reason"] for r in count["rows"]] == ["same: the checkpoint keeps the block's input"]


def test_the_counter_counts_a_storage_once_in_its_dtype_and_skips_parameters():
    """x * x saves x twice, the three views of one buffer are one storage, the weight is a parameter."""
    linear = torch.nn.Linear(4, 6, bias=False, dtype=torch.bfloat16)
    x = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    with SavedTensorCounter(linear) as counter:
        y = linear(x * x)  # saves x (twice, once counted) and x * x (with the weight)
        a, b, c = y.chunk(3, dim=1)  # views of y's storage
        (a * b * c).sum()  # saves a, b, c and a * b: y's storage once, then a * b
    assert [(s.module, s.dtype, s.shape, s.nbytes) for s in counter.saved] == [
        ("", "torch.bfloat16", (3, 4), 24),
        ("", "torch.bfloat16", (3, 4), 24),
        ("", "torch.bfloat16", (3, 2), 36),
        ("", "torch.bfloat16", (3, 2), 12),
    ]
    assert counter.total_bytes == 96


class CpuRNGTracker:
    """Stands in for megatron's CudaRNGStatesTracker: dropout draws from the default CPU generator."""

    def fork(self, name: str = "model-parallel-rng"):
        return contextlib.nullcontext()


def megatron_count(tp: int) -> dict:
    """What one megatron-core TransformerLayer (local spec) saves for backward at tensor-parallel size `tp`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    with megatron_parallel_state(tensor_model_parallel_size=tp):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=H,
            num_attention_heads=A,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            params_dtype=torch.bfloat16,
            bf16=True,
            tensor_model_parallel_size=tp,
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
        )
        layer = TransformerLayer(config, get_gpt_layer_local_spec().submodules, layer_number=1)
        layer.train()
        x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
        causal = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), diagonal=1)  # True: masked out
        with SavedTensorCounter(layer) as counter:
            layer(x, attention_mask=causal)
        return {"counted_bytes": counter.total_bytes, "saved": [dataclasses.asdict(s) for s in counter.saved]}


@functools.cache
def megatron_counts() -> dict:
    """{configuration: count} of megatron-core 0.16.1's own TransformerLayer (the local GPT spec: torch LayerNorm,
    its Column/RowParallelLinear, the unfused DotProductAttention; no Transformer Engine), with the reference's
    counter, without and with tensor parallelism (t = 2), on this rank.

    On the CPU with three substitutions, none of which changes what is saved: torch.cuda.current_device()
    answers "cpu" (reference.measure.torch_patches.cuda_calls_on_cpu), the causal mask is passed in (megatron would
    build its default one on "cuda"), and the CUDA RNG tracker's fork is a no-op (CpuRNGTracker, for the count only:
    a CPU-only torch has no CUDA generator; the masks' values are not counted). Sequence parallelism is not run:
    the local spec's LayerNorm is torch's, which refuses it
    (megatron-lm:megatron/core/transformer/torch_norm.py::WrappedTorchNorm.__new__); nor is recomputation:
    megatron's CheckpointFunction saves all CUDA generator states before it runs the region
    (megatron-lm:megatron/core/tensor_parallel/random.py::CheckpointFunction.forward)."""
    cuda_calls_on_cpu()
    from megatron.core.tensor_parallel import random as megatron_random

    saved = megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    try:
        return {"no parallelism": megatron_count(1), "tensor parallel": megatron_count(T)}
    finally:
        megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved


def _megatron_extras(t: int) -> dict[str, int]:
    """What megatron-core's layer keeps beyond the paper's terms, on CPU in bf16 (t: tensor-parallel size)."""
    return {
        "LayerNorm mean and rstd, fp32 (its LayerNorm weights are fp32)": 2 * 2 * S * B * 4,
        "the causal mask, bool s x s, saved by masked_fill (an input, not split)": S * S,
        "softmax output in fp32 (attention_softmax_in_fp32): 4as^2b/t, not 2as^2b/t": 2 * AS2B // t,
        "attention dropout: bf16 noise, not a 1-byte mask": AS2B // t,
        "hidden dropouts: bf16 noise, not 1-byte masks (replicated without SP)": 2 * SBH,
    }


@on_ranks(2)
@pytest.mark.upstream("megatron-lm")
@pytest.mark.parametrize("configuration, t", [("no parallelism", 1), ("tensor parallel", T)])
def test_megatron_transformer_layer_keeps_the_paper_terms_plus_named_extras(ranks, configuration, t):
    """megatron-core 0.16.1's TransformerLayer (local spec) counted with the same hooks: Table 2 plus the
    extras named here, to the byte."""
    counted = megatron_counts()[configuration]["counted_bytes"]
    assert counted == _counts()[configuration]["table2_bytes"] + sum(_megatron_extras(t).values())


@on_ranks(2)
@pytest.mark.upstream("megatron-lm")
@pytest.mark.parametrize("configuration, t", [("no parallelism", 1), ("tensor parallel", T)])
def test_megatron_keeps_q_k_v_as_one_bf16_buffer_the_papers_6sbh(ranks, configuration, t):
    """Its unfused attention saves views of the fused QKV output: the paper's 6sbh/t exactly, where the
    reference's CPU SDPA keeps fp32 copies (12sbh/t)."""
    core = [s for s in megatron_counts()[configuration]["saved"] if s["module"] == "self_attention.core_attention"]
    assert (core[0]["dtype"], core[0]["nbytes"]) == ("torch.bfloat16", 6 * SBH // t)
    assert (core[1]["dtype"], core[1]["nbytes"]) == ("torch.bfloat16", 2 * AS2B // t)  # dropout output for x V


@pytest.mark.freshness
@on_ranks(2)
def test_the_committed_trace_the_scale_page_shows_is_this_run(ranks):
    """reading_notes/traces/activation_memory.json (tools/record-traces, the benchmark's --json at this
    shape) holds the counts a fresh run gives: re-record it after changing the block or the counting."""
    trace = json.loads(TRACE.read_text())
    assert (trace["world"], trace["shape"]) == (T, {"s": S, "b": B, "h": H, "a": A})
    assert trace["configurations"] == json.loads(json.dumps(counts()))
    assert trace["llama"]["shape"] == {"s": S, "b": B, "h": H, "a": A, "k": K, "f": F}
    assert trace["llama"]["configurations"] == json.loads(json.dumps(counts("llama")))


def _llama_counts() -> dict[str, dict]:
    return {c["configuration"]: c for c in counts("llama")}


@on_ranks(2)
def test_every_configuration_is_counted_for_the_llama_block_on_every_rank(ranks):
    assert [c["configuration"] for c in counts("llama")] == list(CONFIGURATIONS)
    first, second = every_rank(counts("llama"))
    assert first == second
    assert counts("llama")[1]["setting"] == {
        "s": S, "b": B, "h": H, "a": A, "t": T, "sequence_parallel": False, "recompute": "none", "k": K, "f": F
    }  # fmt: skip


@on_ranks(2)
@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_every_byte_the_llama_block_keeps_is_in_a_term_of_its_closed_form(ranks, configuration):
    count = _llama_counts()[configuration]
    assert sum(r["measured_bytes"] for r in count["rows"]) == count["counted_bytes"]
    for row in count["rows"]:
        assert row["measured_bytes"] == row["expected_bytes"], row


@on_ranks(2)
def test_the_llama_closed_forms(ranks):
    """The forms llama_block.FORMULAS states, evaluated here by hand at s 32, b 2, h 64, a 4, k 2, f 160 (no
    parallelism at t = 1, the others at t = 2)."""
    rotary = 8 * SD  # cos and sin: four bf16 casts, or the two fp32 checkpoint inputs
    assert {name: c["counted_bytes"] for name, c in _llama_counts().items()} == {
        "no parallelism": SBH * (26 + 6 * K // A) + 8 * SB + 4 * A * SB + 8 * SB * F + rotary,
        "tensor parallel": 20 * SBH + SBH * (6 + 6 * K // A) // T + 8 * SB + (4 * A * SB + 8 * SB * F) // T + rotary,
        "tensor + sequence parallel": (SBH * (26 + 6 * K // A) + 8 * SB + 4 * A * SB + 8 * SB * F) // T + rotary,
        "tensor + sequence parallel + selective recompute": (SBH * (24 + 4 * K // A) + 8 * SB + 8 * SB * F) // T
        + rotary,
        "full recompute": 2 * SBH + rotary,
    }


@on_ranks(1)
def test_the_llama_closed_form_at_t1_is_the_world_1_count(ranks):
    """The world-2 run counts "no parallelism" on a size-1 group (the committed trace holds it, as
    test_the_committed_trace_the_scale_page_shows_is_this_run checks): the same bytes as a world of one."""
    (alone,) = json.loads(json.dumps(counts("llama")))
    assert alone == json.loads(TRACE.read_text())["llama"]["configurations"][0]


@on_ranks(2)
@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_the_llama_paper_column_is_table2_for_a_gpt2_layer_of_its_size(ranks, configuration):
    """Every paper term is named by the Llama term that replaces it, so the column sums to Table 2."""
    count = _llama_counts()[configuration]
    assert (
        sum(r["paper_bytes"] for r in count["rows"])
        == count["table2_bytes"]
        == _counts()[configuration]["table2_bytes"]
    )


@on_ranks(2)
def test_llama_no_parallelism_term_by_term(ranks):
    """(term, the GPT-2 paper term's bytes, counted bytes): no s^2 term, fp32 RMSNorm copies, the whole QKV and
    [gate; up] buffers behind their views, rotary casts."""
    assert [(r["term"], r["paper_bytes"], r["measured_bytes"]) for r in _llama_counts()["no parallelism"]["rows"]] == [
        ("RMSNorm inputs, fp32 copies, 2 x 4sbh", 4 * SBH, 8 * SBH),
        ("RMSNorm normalized x / rms, fp32, 2 x 4sbh", 0, 8 * SBH),
        ("RMSNorm 1 / rms, fp32, 2 x 4sb", 0, 8 * SB),
        ("QKV projection input, 2sbh", 2 * SBH, 2 * SBH),
        ("rotary cos and sin cast to bf16, for q and for k, 4 x 2sd", 0, 8 * SD),
        ("rotated Q, 2sbh/t", 2 * SBH, 2 * SBH),
        ("rotated K, k heads, 2sbh k/(at)", 2 * SBH, 2 * SBH * K // A),
        ("V: the fused QKV output it is a view of, 2sbh(a + 2k)/(at)", 2 * SBH, 2 * SBH * (A + 2 * K) // A),
        ("SDPA logsumexp, fp32, 4asb/t", 5 * AS2B, 4 * A * SB),
        ("o-proj input (the attention output), 2sbh/t", 2 * SBH, 2 * SBH),
        ("residual dropout masks: none", 2 * SBH, 0),
        ("gate/up projection input, 2sbh", 2 * SBH, 2 * SBH),
        ("SiLU input: the fused [gate; up] output, 4sbf/t", 8 * SBH, 4 * SB * F),
        ("SiLU output, the product's first operand, 2sbf/t", 0, 2 * SB * F),
        ("down projection input: the product, 2sbf/t", 8 * SBH, 2 * SB * F),
    ]


@on_ranks(2)
def test_llama_totals_shrink_with_each_configuration_and_full_keeps_the_checkpoint_inputs(ranks):
    """TP splits heads and SwiGLU columns, SP the norms and column inputs, selective drops rotated Q and K and
    the logsumexp (no s^2 tensor is left to drop); full keeps the layer input and the fp32 rotary tables."""
    none, tp, sp, selective, full = (c["counted_bytes"] for c in _llama_counts().values())
    assert none > tp > sp > selective > full
    assert sp - selective == (2 * SBH + 2 * SBH * K // A + 4 * A * SB) // T
    assert full == 2 * SBH + 2 * S * (H // A) * 4
    assert [r["term"] for r in _llama_counts()["full recompute"]["rows"]] == [
        "layer input, 2sbh",
        "rotary cos and sin, fp32 checkpoint inputs, 2 x 4sd",
    ]


@pytest.mark.parametrize(
    "record",
    [
        SavedTensor("mlp.act", "torch.bfloat16", (S, B, F), 2 * SB * F),  # a module the block has not
        SavedTensor("", "torch.bfloat16", (S, B, H), 2 * SBH),  # a block-level save without full recompute
    ],
)
def test_a_llama_record_no_term_fits_is_an_error(record):
    with pytest.raises(ValueError, match="unexplained saved tensor"):
        classify([record], LlamaSetting.of("no parallelism", S, B, H, A, 1, k=K, f=F))


@on_ranks(1, devices=DEVICES[1:])
def test_the_benchmark_on_one_gpu_adds_the_allocators_bytes_to_every_configuration(ranks):
    """benchmarks/bench_activation_memory.py at t = 1 on the GPU: beside each count, what the forward left
    allocated (at most the peak), and full recompute leaves less than keeping everything."""
    from benchmarks import bench_activation_memory

    out = io.StringIO()
    argv = ["--seq-length", str(S), "--batch-size", str(B), "--hidden-size", str(H), "--num-attention-heads", str(A)]
    with contextlib.redirect_stdout(out):
        bench_activation_memory.main([*argv, "--num-kv-heads", str(K), "--ffn-hidden-size", str(F), "--json"])
    report = json.loads(out.getvalue())
    assert report["device"] == "cuda" and report["world"] == 1
    for model in (report, report["llama"]):
        allocated = {c["configuration"]: c["cuda_allocated_bytes"] for c in model["configurations"]}
        assert all(0 <= c["cuda_allocated_bytes"] <= c["cuda_peak_bytes"] for c in model["configurations"])
        # Full recompute keeps only the block's input, allocated before the forward: the allocator adds nothing
        # (0 B on an H200, 2.11), while the rest keep tens of kB.
        assert allocated["full recompute"] < allocated["no parallelism"], allocated

"""The Llama 3 presets of the scale simulation are the models people train: their parameter count is Hugging
Face's LlamaForCausalLM's at Llama 3's published LlamaConfig (built by hand, on the meta device: no download),
and the reference Llama block's trace (GQA, SwiGLU, RMSNorm, no biases) equals the closed forms of
reference.measure.scale.formulas on every stage kind, at Llama-3-70B's sizes and on a small Llama shape, each
DP sharding included. The GPT-block preset is named for what it is, and its old name is refused in one line.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from reference.gpt.model import GPT
from reference.measure.scale import formulas
from reference.measure.scale.__main__ import format_document, main
from reference.measure.scale.shapes import MODELS, ModelShape, ScaleSetup, setup_for
from reference.measure.scale.simulate import default_ranks, shard_rank_of, stage_of, summarize, trace_rank
from tests.launch import ROOT

H, F, A_HEADS, KV, D = 8192, 28672, 64, 8, 128  # Llama-3-70B: h, SwiGLU f, query and key/value heads, head dim
SMALL_LLAMA = ModelShape("small-llama", 4, 64, 8, 96, 1001, 32, micro_batch_size=2, style="llama", num_kv_heads=2)


def hugging_face_count(model: ModelShape) -> int:
    """Parameters of transformers' LlamaForCausalLM at `model`'s sizes, built on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.kv_heads,
        max_position_embeddings=model.seq_length,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def reference_count(model: ModelShape) -> int:
    """Parameters of the reference GPT the trace builds for `model` (whole, unsplit), on the meta device."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(model.gpt_config(), device="meta").parameters())


@pytest.mark.parametrize(
    "name, count", [("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800)], ids=["70b", "405b"]
)
def test_llama3_parameter_count_equals_hugging_faces_llama(name, count):
    """Llama 3's published configs (70B: h 8192, 80 layers, 64 heads, 8 KV heads, FFN 28672; 405B: h 16384, 126
    layers, 128 heads, 8 KV heads, FFN 53248; vocabulary 128256, untied): the closed form, the reference model
    and transformers' LlamaForCausalLM count the same parameters."""
    model = MODELS[name]
    assert formulas.parameter_count(model) == reference_count(model) == hugging_face_count(model) == count


def test_llama3_70b_parameter_count_written_out_from_the_sizes():
    """Embedding and head V h each; a layer: q and o h^2 each, k and v h (k d) each, SwiGLU's three matrices
    h f each, two RMSNorm weights; the final RMSNorm h."""
    layer = 2 * H * H + 2 * H * KV * D + 3 * H * F + 2 * H
    assert formulas.parameter_count(MODELS["llama3-70b"]) == 2 * 128256 * H + 80 * layer + H


def test_the_gpt_shape_preset_is_about_61b_parameters():
    """The reference GPT block at 70B's sizes (multi-head K/V, a two-matrix GELU MLP, learned positions) is not
    Llama-3-70B: 61.2B parameters, not 70.6B."""
    model = MODELS["gpt-70b-shape"]
    assert formulas.parameter_count(model) == reference_count(model) == 61_198_909_440


def test_the_committed_llama3_70b_trace_prints_hugging_faces_count():
    """`python -m reference.measure.scale --model llama3-70b`'s document (reading_notes/traces/scale_llama3_70b.json,
    which tests/reference/test_scale.py traces afresh) prints the count of the model above."""
    doc = json.loads((ROOT / "reading_notes" / "traces" / "scale_llama3_70b.json").read_text())
    assert doc["setup"]["model"]["name"] == "llama3-70b" and doc["parameters"] == 70_553_706_496
    assert doc["agree"]
    line = format_document(doc).splitlines()[1]
    assert line.startswith("70,553,706,496 parameters (70.55 B; Llama block: GQA 64 query / 8 key-value heads")


def test_llama3_70b_middle_stage_in_numbers():
    """The committed layout's middle stage (TP 8 x PP 8 x DP 64, 10 layers, 16 micro-batches, s 8192), written out
    from the sizes: a TP rank's layer holds 2h of RMSNorm and (h (a + 2k) d + h^2 + 3 h f) / 8 of matrices, so
    the bf16 gradients all-reduced are 2 x 10 x that; the activation collectives are the GPT block's, at A = s b h e.
    """
    setup = setup_for("llama3-70b", tp=8, pp=8, dp=64, microbatches=16)
    (rank,) = [r for r in default_ranks(setup) if stage_of(setup, r) == 4]
    held = {}
    rows = summarize(setup, rank, trace_rank(setup, rank, held=held))
    assert all(r.agrees for r in rows), rows
    table = {(r.group, r.op): (r.count, r.nbytes) for r in rows}
    layer = 2 * H + (H * (A_HEADS + 2 * KV) * D + H * H + 3 * H * F) // 8
    a, m, L = 8192 * H * 2, 16, 10
    assert table[("tp", "all_reduce")] == (4 * m * L, 4 * m * L * a)
    assert table[("pp", "send")] == (2 * m, 2 * m * a)
    assert table[("dp", "all_reduce")][1] == 2 * L * layer == held["gradients"] == held["parameters"]


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, pp=2, dp=2),
        dict(tp=2, pp=3, dp=2, sp=True),
        dict(tp=2, pp=2, dp=3, bucket_size=10_000, distributed_optimizer=True, shard_gradients=True),
        dict(tp=1, pp=2, dp=4, sp=True, distributed_optimizer=True),
        dict(tp=2, pp=2, dp=2, sp=True, virtual_stages=2, bucket_size=20_000),
        dict(tp=2, pp=1, dp=3, sp=True, fsdp2=True, microbatches=1),
        dict(tp=2, pp=1, dp=4, sp=True, fsdp2=True, dp_replicate=2, microbatches=1),
    ],
    ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()),
)
@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama3", "qwen2-bias"])
def test_small_llama_layouts_every_stage_equals_the_formulas(layout, qkv_bias):
    setup = ScaleSetup(dataclasses.replace(SMALL_LLAMA, qkv_bias=qkv_bias), **{"microbatches": 2, **layout})
    for rank in {*default_ranks(setup), setup.world - 1}:  # every stage kind, and a last TP / DP rank
        held = {}
        rows = summarize(setup, rank, trace_rank(setup, rank, held=held))
        assert all(r.agrees for r in rows), [r for r in rows if not r.agrees]
        assert held == formulas.memory(setup, stage_of(setup, rank), shard_rank_of(setup, rank))


def test_a_gpt_block_formula_does_not_fit_the_llama_trace():
    """Negative control: the Llama trace compared with the GPT block's formulas at the same sizes disagrees on the
    DP gradients (other parameters) and, under SP, on the norms' all-reduce."""
    setup = ScaleSetup(SMALL_LLAMA, tp=2, pp=2, dp=2, microbatches=2, sp=True)
    events = trace_rank(setup, 0)
    gpt = dataclasses.replace(setup, model=dataclasses.replace(SMALL_LLAMA, style="gpt2", num_kv_heads=None))
    wrong = {(r.group, r.op) for r in summarize(gpt, 0, events) if not r.agrees}
    assert wrong == {("dp", "all_reduce"), ("tp", "all_reduce")}


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            "--model 70b",
            "--model 70b was the reference GPT block at Llama-70B's sizes (about 61B parameters): it is "
            "now gpt-70b-shape; Llama-3-70B itself is llama3-70b",
        ),
        ("--model llama3-70b --tp 16 --pp 1 --dp 1", "8 key/value heads cannot be split over tensor-parallel size 16"),
        ("--model llama3-405b --tp 8 --cp 16 --pp 16 --dp 1", "--cp with llama3-405b: the reference ring sends K/V"),
    ],
    ids=["old-name", "kv-heads-tp", "cp-gqa"],
)
def test_llama_and_renamed_presets_are_refused_in_one_line(capsys, argv, message):
    assert main(argv.split()) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err

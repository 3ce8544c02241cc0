"""What the reference Llama/Qwen2 block saves for backward, term by term: the closed form derived from the block,
each term next to the GPT-2 term of Korthikanti et al. 2022 it replaces and the reason its bytes differ.

The paper has no table for this block. Sizes: s sequence, b micro-batch, h hidden, a query heads, k key/value
heads, d = h / a head size, f SwiGLU hidden size (gate and up each), t tensor-parallel size. Measured on CPU with
bf16 parameters and activations. The differences come from RMSNorm's fp32 copies, the rotary tables' casts,
grouped-query attention's fused QKV buffer, CPU's flash attention kernel, SwiGLU's views of its fused buffer and
the absence of dropout; the Scale note explains each.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import torch

from reference.measure.activation_memory.counting import SavedTensor
from reference.measure.activation_memory.paper import Setting, term_bytes
from reference.measure.activation_memory.term_table import SAME, Row, Term, table, tally

FORMULAS = {  # bytes per layer, the sum of terms(); d = h / a
    "no parallelism": "sbh(26 + 6k/a) + 8sb + 4asb + 8sbf + 8sd",
    "tensor parallel": "sbh(20 + (6 + 6k/a)/t) + 8sb + (4asb + 8sbf)/t + 8sd",
    "tensor + sequence parallel": "sbh(26 + 6k/a)/t + (8sb + 4asb + 8sbf)/t + 8sd",
    "tensor + sequence parallel + selective recompute": "sbh(24 + 4k/a)/t + (8sb + 8sbf)/t + 8sd",
    "full recompute": "2sbh + 8sd",
}
LINEAR_INPUTS = {
    "attention.qkv": "qkv_input",
    "attention.proj": "projection_input",
    "mlp.fc1": "fc1_input",
    "mlp.fc2": "down_input",
}


@dataclasses.dataclass(frozen=True)
class LlamaSetting(Setting):
    """A Setting with the Llama block's two extra sizes."""

    k: int  # key/value heads (grouped-query attention)
    f: int  # SwiGLU hidden size

    @classmethod
    def of(cls, configuration: str, s: int, b: int, h: int, a: int, t: int, *, k: int, f: int) -> LlamaSetting:
        return cls(**dataclasses.asdict(Setting.of(configuration, s, b, h, a, t)), k=k, f=f)

    @property
    def d(self) -> int:
        return self.h // self.a


def terms(x: LlamaSetting) -> list[Term]:
    """The closed form of the configuration, term by term, in the order of the layer."""
    sbh, sb, sd = x.sbh, x.s * x.b, x.s * x.d

    def sp(n: int) -> Fraction:
        return Fraction(n, x.split("sp"))

    def tp(n: int) -> Fraction:
        return Fraction(n, x.split("tp"))

    rotary_fp32 = Term(
        "rotary_tables_fp32",
        "rotary cos and sin, fp32 checkpoint inputs, 2 x 4sd",
        0,
        Fraction(8 * sd),
        "no paper term (GPT-2's positions are added before the layer); the checkpoint keeps the tables as "
        "passed, fp32 and whole on every rank",
    )
    if x.recompute == "full":
        layer_input = Term("layer_input", "layer input, 2sbh", term_bytes("layer_input", x), Fraction(2 * sbh), SAME)
        return [layer_input, rotary_fp32]
    if x.recompute == "selective":
        attention = [
            Term(
                "qkv_output",
                "fused QKV output (selective recompute's input), 2sbh(a + 2k)/(at)",
                term_bytes("q_k_v", x),
                tp(2 * sb * (x.a + 2 * x.k) * x.d),
                "the paper's Q, K, V 6sbh/t; GQA: K and V have k heads, so (a + 2k)/(3a) of it",
            ),
            rotary_fp32,
        ]
    else:
        attention = [
            Term(
                "rotary_tables",
                "rotary cos and sin cast to bf16, for q and for k, 4 x 2sd",
                0,
                Fraction(8 * sd),
                "no paper term; apply_rotary casts the fp32 tables on each call and the products keep the "
                "casts, the whole sequence on every rank (not split by t)",
            ),
            Term(
                "rotated_q", "rotated Q, 2sbh/t", term_bytes("q_k", x) / 2, tp(2 * sbh), "same: Q of the paper's Q, K"
            ),
            Term(
                "rotated_k",
                "rotated K, k heads, 2sbh k/(at)",
                term_bytes("q_k", x) / 2,
                tp(2 * sbh * x.k // x.a),
                "K of the paper's Q, K; GQA keeps k heads, not a: k/a of it",
            ),
            Term(
                "v_in_qkv_buffer",
                "V: the fused QKV output it is a view of, 2sbh(a + 2k)/(at)",
                term_bytes("v", x),
                tp(2 * sb * (x.a + 2 * x.k) * x.d),
                "the paper's V, 2sbh/t; V is a view into the QKV projection's output, which stays whole "
                "(Q and K before rotary included)",
            ),
            Term(
                "logsumexp",
                "SDPA logsumexp, fp32, 4asb/t",
                sum(
                    term_bytes(key, x)
                    for key in ("softmax_output", "attention_dropout_mask", "attention_dropout_output")
                ),
                tp(4 * x.a * sb),
                "replaces the paper's softmax output, dropout mask and dropout output (5as^2b/t): CPU's flash "
                "kernel keeps one fp32 logsumexp per query and head and rebuilds the probabilities in backward; "
                "no attention dropout",
            ),
        ]
    return [
        Term(
            "rmsnorm_inputs",
            "RMSNorm inputs, fp32 copies, 2 x 4sbh",
            term_bytes("layernorm_inputs", x),
            sp(8 * sbh),
            "the paper's LayerNorm inputs; CPU rms_norm upcasts bf16 to fp32 and keeps the copy: 4 bytes, not 2",
        ),
        Term(
            "rmsnorm_normalized",
            "RMSNorm normalized x / rms, fp32, 2 x 4sbh",
            0,
            sp(8 * sbh),
            "no paper term; kept for the weight's gradient (LayerNorm's backward rebuilds it from its statistics)",
        ),
        Term(
            "rmsnorm_rstd",
            "RMSNorm 1 / rms, fp32, 2 x 4sb",
            0,
            sp(8 * sb),
            "the O(sb) statistic the paper leaves out (LayerNorm's mean and rstd in the GPT-2 block)",
        ),
        Term("qkv_input", "QKV projection input, 2sbh", term_bytes("qkv_input", x), sp(2 * sbh), SAME),
        *attention,
        Term(
            "projection_input",
            "o-proj input (the attention output), 2sbh/t",
            term_bytes("projection_input", x),
            tp(2 * sbh),
            "same; without recompute one storage, kept by SDPA (its backward needs its output) and the o-proj",
        ),
        Term(
            "hidden_dropout_masks",
            "residual dropout masks: none",
            term_bytes("hidden_dropout_masks", x),
            0,
            "the paper's 2sbh of masks; the block has no dropout",
        ),
        Term("fc1_input", "gate/up projection input, 2sbh", term_bytes("fc1_input", x), sp(2 * sbh), SAME),
        Term(
            "silu_input",
            "SiLU input: the fused [gate; up] output, 4sbf/t",
            term_bytes("gelu_input", x),
            tp(4 * sb * x.f),
            "replaces the GeLU input (8sbh/t at f = 4h); gate is a view of the [gate; up] buffer, so the whole "
            "buffer stays, up (the product's other operand) included",
        ),
        Term(
            "silu_output",
            "SiLU output, the product's first operand, 2sbf/t",
            0,
            tp(2 * sb * x.f),
            "no paper term: GeLU feeds fc2 directly, SwiGLU multiplies first",
        ),
        Term(
            "down_input",
            "down projection input: the product, 2sbf/t",
            term_bytes("fc2_input", x),
            tp(2 * sb * x.f),
            "the paper's second MLP linear input with f for 4h",
        ),
    ]


def _is_view_of_a_larger_buffer(record: SavedTensor) -> bool:
    itemsize = getattr(torch, record.dtype.removeprefix("torch.")).itemsize
    return record.nbytes > itemsize * torch.Size(record.shape).numel()


def classify(saved: list[SavedTensor], x: LlamaSetting) -> dict[str, int]:
    """Bytes per term key of the records of one block, by the module that saved them, then shape and dtype."""
    norms = {ln: iter(["rmsnorm_inputs", "rmsnorm_normalized"]) for ln in ("ln1", "ln2")}  # pow's, then mul's
    query_heads = iter(["rotated_q", "projection_input"])  # SDPA keeps its query, then its output
    tables = (x.s, x.d)

    def key_of(record: SavedTensor) -> str | None:
        fp32 = record.dtype == "torch.float32"
        if record.module in norms:
            return "rmsnorm_rstd" if record.shape[-1] == 1 else next(norms[record.module], None)
        if record.module in LINEAR_INPUTS:
            return LINEAR_INPUTS[record.module]
        if record.module == "mlp":
            return "silu_input" if _is_view_of_a_larger_buffer(record) else "silu_output"
        if record.shape == tables:
            return "rotary_tables_fp32" if fp32 else "rotary_tables"
        if record.module == "attention" and x.recompute == "selective":
            return "qkv_output"
        if record.module == "attention":
            if fp32:
                return "logsumexp"
            if _is_view_of_a_larger_buffer(record):
                return "v_in_qkv_buffer"
            return "rotated_k" if record.shape[1] == x.k // x.t else next(query_heads, None)
        if record.module == "" and x.recompute == "full":
            return "layer_input"
        return None

    return tally(saved, key_of)


def rows(saved: list[SavedTensor], x: LlamaSetting) -> list[Row]:
    """The term table of one configuration; every counted byte in a row."""
    return table(terms(x), classify(saved, x))

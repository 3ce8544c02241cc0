"""What the reference GPT-2 block saves for backward, term by term against Korthikanti et al. 2022, with the
reason for every byte that differs.

Measured on CPU with bf16 parameters and activations and dropout on. Each difference has one of four causes,
named in its row: attention computed in fp32 on CPU's math path, dropout saving a noise tensor where the paper
counts a 1-byte mask, LayerNorm's per-token statistics (which the paper leaves out), and residual and bias
additions saving nothing. Everything else is the paper's term byte for byte; a record that fits no row is an
error, an unexplained difference. The Scale note shows the table and explains each cause.
"""

from __future__ import annotations

from reference.measure.activation_memory.counting import SavedTensor
from reference.measure.activation_memory.paper import TERMS, Setting, term_bytes, terms_for
from reference.measure.activation_memory.term_table import SAME, Row, Term, table, tally

FP32_ATTENTION = "CPU SDPA math path computes bf16 attention in fp32: 4-byte copies instead of 2"
NOISE_MASK_FP32 = "CPU dropout saves an fp32 noise tensor (4 bytes/element), not a 1-byte mask"
NOISE_MASK_BF16 = "CPU dropout saves a bf16 noise tensor (2 bytes/element), not a 1-byte mask"

# key: (bytes per element of the reference over the paper's, reason); LayerNorm statistics have no paper term
REFERENCE = {
    "layernorm_inputs": (1, SAME),
    "qkv_input": (1, SAME),
    "q_k": (2, FP32_ATTENTION + " (scaled Q and K^T)"),
    "softmax_output": (2, FP32_ATTENTION),
    "attention_dropout_mask": (4, NOISE_MASK_FP32),
    "attention_dropout_output": (2, FP32_ATTENTION),
    "v": (2, FP32_ATTENTION),
    "q_k_v": (1, "same: the checkpoint keeps the fused QKV output, bf16"),
    "projection_input": (1, SAME),
    "hidden_dropout_masks": (2, NOISE_MASK_BF16),
    "fc1_input": (1, SAME),
    "gelu_input": (1, SAME),
    "fc2_input": (1, "same: the GeLU output, saved by the second linear layer"),
    "layer_input": (1, "same: the checkpoint keeps the block's input"),
}
LAYERNORM_STATISTICS = (
    "LayerNorm mean and rstd, 2 LayerNorms x 2 x sb; not counted by the paper (O(sb))",
    "layernorm_statistics",
)
LINEAR_INPUTS = {
    "attention.qkv": "qkv_input",
    "attention.proj": "projection_input",
    "mlp.fc1": "fc1_input",
    "mlp.fc2": "fc2_input",
    "mlp": "gelu_input",
}


def classify(saved: list[SavedTensor], x: Setting) -> dict[str, int]:
    """Bytes per term key of the records of one block, by the module that saved them."""
    attention_core = iter(["q_k", "q_k", "v"])
    attention_s2 = iter(["softmax_output", "attention_dropout_mask", "attention_dropout_output"])

    def key_of(record: SavedTensor) -> str | None:
        if record.module in ("ln1", "ln2"):
            return "layernorm_statistics" if record.shape[-1] == 1 else "layernorm_inputs"
        if record.module in LINEAR_INPUTS:
            return LINEAR_INPUTS[record.module]
        if record.module == "attention":
            if x.recompute == "selective":
                return "q_k_v"
            return next(attention_s2 if record.shape[-2:] == (x.s, x.s) else attention_core, None)
        if record.module == "":
            return "layer_input" if x.recompute == "full" else "hidden_dropout_masks"
        return None

    return tally(saved, key_of)


def _layernorm_statistics_bytes(x: Setting) -> int:
    return 2 * 2 * x.s * x.b * 2 // x.split("sp")  # 2 LayerNorms x (mean, rstd) x sb tokens x 2 bytes


def rows(saved: list[SavedTensor], x: Setting) -> list[Row]:
    """The term table of one configuration: every paper term, then the reference's extra terms."""
    terms = []
    for key in terms_for(x):
        ratio, reason = REFERENCE[key]
        paper = term_bytes(key, x)
        terms.append(Term(key, TERMS[key][0], paper, paper * ratio, reason))
    if x.recompute != "full":
        words, key = LAYERNORM_STATISTICS
        reason = "torch's LayerNorm keeps them for backward; bf16 on CPU"
        terms.append(Term(key, words, 0, _layernorm_statistics_bytes(x), reason))
    return table(terms, classify(saved, x))

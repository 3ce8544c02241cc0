"""Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models": the activation
bytes of one transformer layer in 16-bit activations, Table 2 and the terms of Section 4.1 it sums.

s sequence length, b micro-batch size, h hidden size, a attention heads, t tensor-parallel size. Each term is
(bytes per element times elements) and is divided by t when tensor parallelism splits it (heads, MLP columns)
or, when sequence parallelism is on, when it lies in the sequence-split part (LayerNorm, dropout, the inputs
of the column layers). Selective recomputation drops the three s^2 terms; full recomputation keeps only the
layer's input.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

FORMULAS = {  # Table 2, activation bytes per layer
    "no parallelism": "sbh(34 + 5as/h)",
    "tensor parallel": "sbh(10 + 24/t + 5as/(ht))",
    "tensor + sequence parallel": "sbh(34/t + 5as/(ht))",
    "tensor + sequence parallel + selective recompute": "sbh(34/t)",
    "full recompute": "2sbh",
}
CONFIGURATIONS = {  # name: (tensor parallel, sequence parallel, recompute), in Table 2's order
    "no parallelism": (False, False, "none"),
    "tensor parallel": (True, False, "none"),
    "tensor + sequence parallel": (True, True, "none"),
    "tensor + sequence parallel + selective recompute": (True, True, "selective"),
    "full recompute": (True, False, "full"),
}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One layer's shape and parallelism; t is 1 without tensor parallelism."""

    s: int
    b: int
    h: int
    a: int
    t: int
    sequence_parallel: bool
    recompute: str

    @classmethod
    def of(cls, configuration: str, s: int, b: int, h: int, a: int, t: int) -> Setting:
        tensor_parallel, sequence_parallel, recompute = CONFIGURATIONS[configuration]
        return cls(s, b, h, a, t if tensor_parallel else 1, sequence_parallel, recompute)

    @property
    def sbh(self) -> int:
        return self.s * self.b * self.h

    @property
    def as2b(self) -> int:
        return self.a * self.s * self.s * self.b

    def split(self, by: str) -> int:
        """The divisor of a term split by "tp" (always t) or "sp" (t under sequence parallelism)."""
        return self.t if by == "tp" or (by == "sp" and self.sequence_parallel) else 1


def table2_bytes(x: Setting) -> Fraction:
    """Table 2's closed form for the setting (full recompute: 2sbh, whatever t)."""
    s, b, h, a, t = x.s, x.b, x.h, x.a, x.t
    if x.recompute == "full":
        return Fraction(2 * s * b * h)
    if x.recompute == "selective":
        return s * b * h * Fraction(34, t)
    if x.sequence_parallel:
        return s * b * h * (Fraction(34, t) + Fraction(5 * a * s, h * t))
    return s * b * h * (10 + Fraction(24, t) + Fraction(5 * a * s, h * t))


# key: (the paper's words, bytes before splitting as a function of the setting, split by)
TERMS = {
    "layernorm_inputs": ("LayerNorm inputs, 2 x 2sbh", lambda x: 4 * x.sbh, "sp"),
    "qkv_input": ("QKV projection input, 2sbh", lambda x: 2 * x.sbh, "sp"),
    "q_k": ("Q and K for QK^T, 4sbh", lambda x: 4 * x.sbh, "tp"),
    "softmax_output": ("softmax output, 2as^2b", lambda x: 2 * x.as2b, "tp"),
    "attention_dropout_mask": ("softmax dropout mask, as^2b", lambda x: x.as2b, "tp"),
    "attention_dropout_output": ("softmax dropout output (for x V), 2as^2b", lambda x: 2 * x.as2b, "tp"),
    "v": ("V for attention over values, 2sbh", lambda x: 2 * x.sbh, "tp"),
    "q_k_v": ("Q, K and V (kept by selective recompute), 6sbh", lambda x: 6 * x.sbh, "tp"),
    "projection_input": ("output projection input, 2sbh", lambda x: 2 * x.sbh, "tp"),
    "hidden_dropout_masks": ("attention and MLP dropout masks, 2 x sbh", lambda x: 2 * x.sbh, "sp"),
    "fc1_input": ("MLP first linear input, 2sbh", lambda x: 2 * x.sbh, "sp"),
    "gelu_input": ("GeLU input, 8sbh", lambda x: 8 * x.sbh, "tp"),
    "fc2_input": ("MLP second linear input, 8sbh", lambda x: 8 * x.sbh, "tp"),
    "layer_input": ("layer input (full recompute), 2sbh", lambda x: 2 * x.sbh, "none"),
}


def terms_for(x: Setting) -> list[str]:
    """The terms the paper counts in the setting, in the order of the layer."""
    if x.recompute == "full":
        return ["layer_input"]
    attention = (
        ["q_k_v"]
        if x.recompute == "selective"
        else ["q_k", "softmax_output", "attention_dropout_mask", "attention_dropout_output", "v"]
    )
    return [
        "layernorm_inputs",
        "qkv_input",
        *attention,
        "projection_input",
        "hidden_dropout_masks",
        "fc1_input",
        "gelu_input",
        "fc2_input",
    ]


def term_bytes(key: str, x: Setting) -> Fraction:
    _, elements, split = TERMS[key]
    return Fraction(elements(x), x.split(split))

"""What a scale trace simulates: a model shape, a TP x PP x DP layout and the step's settings, checked once.

The 70B preset has Llama-2/3-70B's sizes (80 layers, h 8192, 64 heads, FFN 28672, vocabulary 128256, here at
sequence 4096, micro-batch 1, bf16). The block is this project's: one fused QKV with as many key/value heads
as query heads and a plain GELU MLP. Llama's grouped-query attention (8 KV heads: a smaller QKV weight) and
SwiGLU MLP (three FFN matrices) are not modelled; neither changes an activation collective, both change the
parameter count and so the data-parallel gradient bytes. Embedding and output weights are untied, as in
Llama, so there is no first-to-last-stage embedding all-reduce. The vocabulary is padded to a multiple of
tp only, as reference.tensor_parallel.vocab_parallel does (Megatron-LM pads to a multiple of 128 tp).
The "small" preset is for tests; its vocabulary (1001) needs padding at every TP size above 1.
"""
from __future__ import annotations

import dataclasses
import math

from reference.parallel_state import ORDERS, ParallelConfigError, divide

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DP_MODES = ("allreduce", "distopt")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    micro_batch_size: int = 1
    dtype: str = "bfloat16"


MODELS = {
    "70b": ModelShape("70b", 80, 8192, 64, 28672, 128256, 4096),
    "small": ModelShape("small", 4, 64, 8, 256, 1001, 32, micro_batch_size=2),
}


@dataclasses.dataclass(frozen=True)
class ScaleSetup:
    """One training step of `model` on tp x pp x dp ranks with `microbatches` micro-batches per step.

    sp: sequence parallelism. dp_mode: "allreduce" (DDP: all-reduce the fp32 gradient buffer) or "distopt"
    (Megatron's distributed optimizer: reduce-scatter the fp32 gradients, all-gather the bf16 parameters).
    """
    model: ModelShape
    tp: int
    pp: int
    dp: int
    microbatches: int
    sp: bool = False
    dp_mode: str = "allreduce"
    order: str = "tp-pp-dp"

    def __post_init__(self) -> None:
        m = self.model
        if min(self.tp, self.pp, self.dp, self.microbatches) < 1:
            raise ParallelConfigError(f"tp {self.tp}, pp {self.pp}, dp {self.dp} and microbatches "
                                      f"{self.microbatches} must be >= 1")
        if self.pp > m.num_layers:
            raise ParallelConfigError(f"{self.pp} pipeline stages but only {m.num_layers} layers")
        divide(m.num_layers, self.pp, "num_layers", by="the pipeline-parallel size")
        divide(m.num_attention_heads, self.tp, "num_attention_heads")
        divide(m.hidden_size, m.num_attention_heads, "hidden_size", by="num_attention_heads")
        divide(m.ffn_hidden_size, self.tp, "ffn_hidden_size")
        if self.sp:
            divide(m.seq_length, self.tp, "seq_length")
        if m.dtype not in DTYPE_BYTES:
            raise ParallelConfigError(f"unknown dtype {m.dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
        if self.dp_mode not in DP_MODES:
            raise ParallelConfigError(f"unknown dp mode {self.dp_mode!r}; choose one of {', '.join(DP_MODES)}")
        if self.order not in ORDERS:
            raise ParallelConfigError(f"unknown order {self.order!r}; choose one of {', '.join(ORDERS)}")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layers_per_stage(self) -> int:
        return self.model.num_layers // self.pp

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.model.dtype]

    @property
    def padded_vocab_size(self) -> int:
        """V padded to a multiple of tp (reference.tensor_parallel.vocab_parallel.pad_vocab_size, multiple 1)."""
        return math.ceil(self.model.vocab_size / self.tp) * self.tp

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ScaleSetup":
        return cls(**{**data, "model": ModelShape(**data["model"])})


def setup_for(model: str, **layout) -> ScaleSetup:
    """ScaleSetup for a preset by name (a one-line error for an unknown name)."""
    if model not in MODELS:
        raise ParallelConfigError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    return ScaleSetup(MODELS[model], **layout)

"""What a MoE scale trace simulates: the MoE layers of a model shape on TP x PP x DP ranks with expert
parallelism (EP carved out of DP), at a stated routing skew, checked once.

A MoEShape is the MoE layers only: per layer a top-k router and E SwiGLU experts of hidden size f, no biases
(reference.moe.MoELayer). "mixtral-8x7b" has Mixtral-8x7B's sizes (32 layers, h 4096, 8 experts, top-2, f
14336, router aux-loss coefficient 0.02); "deepseek-v3-moe" DeepSeek-V3's 58 MoE layers (h 7168, 256 routed
experts, top-8, f 2048), without its shared expert, its first 3 dense layers, its auxiliary-loss-free bias and
node-limited routing. Attention (Mixtral's GQA, DeepSeek's MLA), embeddings and head are not part of the
shape. Both at sequence 4096, micro-batch 1, bf16. "moe-small" is for tests.
"""

from __future__ import annotations

import dataclasses
import math

from reference.data_parallel.wrapper import DEFAULT_BUCKET_SIZE
from reference.measure.scale.shapes import DTYPES
from reference.parallel_state import ORDERS, Mesh, ParallelConfigError, divide


@dataclasses.dataclass(frozen=True)
class MoEShape:
    name: str
    num_layers: int  # MoE layers
    hidden_size: int
    num_experts: int
    topk: int
    ffn_hidden_size: int  # each expert's
    seq_length: int
    micro_batch_size: int = 1
    aux_loss_coeff: float = 0.0
    dtype: str = "bfloat16"


MOE_MODELS = {
    "mixtral-8x7b": MoEShape("mixtral-8x7b", 32, 4096, 8, 2, 14336, 4096, aux_loss_coeff=0.02),
    "deepseek-v3-moe": MoEShape("deepseek-v3-moe", 58, 7168, 256, 8, 2048, 4096),
    "moe-small": MoEShape("moe-small", 4, 64, 8, 2, 32, 32, micro_batch_size=2, aux_loss_coeff=0.01),
}


@dataclasses.dataclass(frozen=True)
class MoESetup:
    """`microbatches` through the MoE layers of one rank's pipeline stage, then the gradient reductions.

    ep: expert-parallel size (it divides dp; the expert-DP size is dp / ep). Under TP (tp > 1) the layers take
    sequence-parallel input, as megatron-core requires with EP and TP, and each expert is split over TP (the
    expert-TP size is the TP size, megatron-core's default). routing_skew: the Zipf exponent of
    reference.measure.scale.routing (0: uniform). bucket_size: DDP's, for both gradient reductions.
    """

    model: MoEShape
    tp: int
    pp: int
    dp: int
    ep: int
    microbatches: int
    routing_skew: float = 0.0
    bucket_size: int | None = DEFAULT_BUCKET_SIZE
    order: str = "tp-pp-dp"

    def __post_init__(self) -> None:
        m = self.model
        if min(self.tp, self.pp, self.dp, self.ep, self.microbatches) < 1:
            raise ParallelConfigError(
                f"tp {self.tp}, pp {self.pp}, dp {self.dp}, ep {self.ep} and microbatches {self.microbatches} "
                "must be >= 1"
            )
        if self.pp > m.num_layers:
            raise ParallelConfigError(f"{self.pp} pipeline stages but only {m.num_layers} MoE layers")
        if self.order not in ORDERS:
            raise ParallelConfigError(f"unknown order {self.order!r}; choose one of {', '.join(ORDERS)}")
        divide(m.num_experts, self.ep, "num_experts", by="the expert-parallel size")
        Mesh(self.tp, self.pp, self.dp, ep=self.ep, order=self.order)  # ep divides dp; the order allows EP x PP
        divide(m.ffn_hidden_size, self.tp, "the experts' ffn_hidden_size", by="the tensor-parallel size")
        divide(m.seq_length, self.tp, "seq_length", by="the tensor-parallel size (sequence parallel)")
        if not (math.isfinite(self.routing_skew) and self.routing_skew >= 0):
            raise ParallelConfigError(f"routing skew {self.routing_skew} must be a finite number >= 0")
        if m.dtype not in DTYPES:
            raise ParallelConfigError(f"unknown dtype {m.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ParallelConfigError(f"bucket size {self.bucket_size} must be a positive number of bytes")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """The expert-data-parallel size: ranks holding the same experts (dp / ep)."""
        return self.dp // self.ep

    @property
    def local_experts(self) -> int:
        return self.model.num_experts // self.ep

    @property
    def tokens(self) -> int:
        """Tokens one rank routes per micro-batch: b s, or its sequence slice b s / t under TP."""
        return self.model.micro_batch_size * self.model.seq_length // self.tp

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.model.dtype].itemsize

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def moe_setup_for(model: str, **layout) -> MoESetup:
    """MoESetup for a preset by name (a one-line error for an unknown name)."""
    if model not in MOE_MODELS:
        raise ParallelConfigError(f"unknown MoE model {model!r}; choose one of {', '.join(MOE_MODELS)}")
    return MoESetup(MOE_MODELS[model], **layout)

"""What a scale trace simulates: a model shape, a TP x PP x DP layout and the step's settings, checked once.

Two kinds of preset. "llama3-70b" and "llama3-405b" are Llama 3's published configs on the reference Llama block
(GQA with 8 key/value heads, SwiGLU, RMSNorm, rotary positions, no biases, untied embeddings), at its 8K
pre-training sequence, micro-batch 1, bf16: their parameter count is Hugging Face's LlamaForCausalLM's
(parameter_count). "gpt-70b-shape" is the reference GPT block at Llama-70B's sizes (80 layers, h 8192, 64 heads,
FFN 28672, vocabulary 128256, sequence 4096): full key/value heads, a two-matrix GELU MLP, learned positions,
about 61B parameters, not a model anyone trains; the committed scale_70b* traces are of it. "70b", its old
name, is refused with a line naming both. The "small" preset is for tests; its vocabulary (1001) needs padding
at every TP size above 1.
"""

from __future__ import annotations

import dataclasses

import torch

from reference.data_parallel.wrapper import DEFAULT_BUCKET_SIZE
from reference.gpt.model import GPTConfig
from reference.gpt.parallelize import check_virtual_pipeline
from reference.parallel_state import ORDERS, ParallelConfigError, divide
from reference.pipeline.schedules import ALL_SCHEDULES
from reference.pipeline.zero_bubble import ZERO_BUBBLE_SCHEDULES, check_zero_bubble, stages_of
from reference.tensor_parallel.parallelize import split_query_groups
from reference.tensor_parallel.vocab_parallel import pad_vocab_size

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
    style: str = "gpt2"  # GPTConfig.style: "gpt2" or "llama" (the block reference.gpt.model builds)
    num_kv_heads: int | None = None  # "llama": key/value heads (None: num_attention_heads)
    qkv_bias: bool = True  # "llama": False for Llama 3's bias-free projections

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def llama(self) -> bool:
        return self.style == "llama"

    def gpt_config(self) -> GPTConfig:
        """The reference GPT of this shape (no dropout: a meta tensor has nothing to drop); Llama 3's rotary base
        and RMSNorm epsilon for the llama style (they change no shape)."""
        if self.llama:
            llama = dict(num_kv_heads=self.num_kv_heads, qkv_bias=self.qkv_bias, rope_theta=500_000.0, norm_eps=1e-5)
            return GPTConfig.from_sizes(self, ffn_hidden_size=self.ffn_hidden_size, style="llama", **llama)
        return GPTConfig.from_sizes(self, ffn_hidden_size=self.ffn_hidden_size)

    def to_dict(self) -> dict:
        """The fields, less the block's at the GPT-2 defaults: a trace of a GPT shape reads as before."""
        fields = dataclasses.asdict(self)
        if not self.llama:
            del fields["style"], fields["num_kv_heads"], fields["qkv_bias"]
        return fields


def llama3(name: str, num_layers: int, hidden_size: int, heads: int, ffn_hidden_size: int) -> ModelShape:
    """A Llama 3 config (Meta's published sizes): 8 key/value heads, vocabulary 128256, sequence 8192, no biases."""
    sizes = (num_layers, hidden_size, heads, ffn_hidden_size, 128256, 8192)
    return ModelShape(name, *sizes, style="llama", num_kv_heads=8, qkv_bias=False)


MODELS = {
    "gpt-70b-shape": ModelShape("gpt-70b-shape", 80, 8192, 64, 28672, 128256, 4096),
    "llama3-70b": llama3("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b": llama3("llama3-405b", 126, 16384, 128, 53248),
    "small": ModelShape("small", 4, 64, 8, 256, 1001, 32, micro_batch_size=2),
}
RENAMED = {  # old preset name -> the line refusing it
    "70b": "--model 70b was the reference GPT block at Llama-70B's sizes (about 61B parameters): it is now "
    "gpt-70b-shape; Llama-3-70B itself is llama3-70b",
}


def shape_named(model: str, shapes: dict[str, ModelShape] = MODELS) -> ModelShape:
    """The preset `model` of `shapes`; a one-line ParallelConfigError for an unknown or renamed name."""
    if model in RENAMED:
        raise ParallelConfigError(RENAMED[model])
    if model not in shapes:
        raise ParallelConfigError(f"unknown model {model!r}; choose one of {', '.join(shapes)}")
    return shapes[model]


@dataclasses.dataclass(frozen=True)
class ScaleSetup:
    """One training step (reference.gpt.train.train_step) of `model` on tp x pp x dp ranks.

    microbatches: per step and DP replica. sp: sequence parallelism. schedule: "gpipe" or "1f1b" (the same
    traffic per step, in another order), or a zero-bubble one (reference.pipeline.zero_bubble: zb-h1 the same
    traffic again; zbv and dualpipev two stages per rank in a V, `chunks` 2). bucket_size: the DDP gradient
    bucket size in bytes (None: one bucket), reference.data_parallel.DistributedDataParallel's.
    distributed_optimizer: ZeRO-1 (reference.data_parallel.distributed_optimizer) instead of every DP rank
    stepping every parameter;
    shard_gradients: with it, ZeRO-2 (reference.data_parallel.gradient_shards), only gradient shards kept.
    virtual_stages: model chunks per stage (v > 1: interleaved 1F1B, reference.gpt.parallelize.build_chunks;
    each chunk its own DDP). fsdp2: the reference FSDP2 over DP instead of DDP (reference.data_parallel.fsdp2_tp:
    fp32 shards, compute and all-gathers in the model's dtype, gradients reduce-scattered in fp32; pp 1, one
    micro-batch); dp_replicate: HSDP, the DP group as that many replicas of dp / dp_replicate shard ranks.
    """

    model: ModelShape
    tp: int
    pp: int
    dp: int
    microbatches: int
    sp: bool = False
    schedule: str = "1f1b"
    bucket_size: int | None = DEFAULT_BUCKET_SIZE
    order: str = "tp-pp-dp"
    distributed_optimizer: bool = False
    shard_gradients: bool = False
    virtual_stages: int = 1
    fsdp2: bool = False
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        m = self.model
        if min(self.tp, self.pp, self.dp, self.microbatches) < 1:
            raise ParallelConfigError(
                f"tp {self.tp}, pp {self.pp}, dp {self.dp} and microbatches {self.microbatches} must be >= 1"
            )
        if self.pp > m.num_layers:
            raise ParallelConfigError(f"{self.pp} pipeline stages but only {m.num_layers} layers")
        divide(m.num_attention_heads, self.tp, "num_attention_heads")
        divide(m.hidden_size, m.num_attention_heads, "hidden_size", by="num_attention_heads")
        if m.llama:
            split_query_groups(m.num_attention_heads, m.kv_heads, self.tp)
        divide(m.ffn_hidden_size, self.tp, "ffn_hidden_size")
        if self.sp:
            divide(m.seq_length, self.tp, "seq_length")
        if m.dtype not in DTYPES:
            raise ParallelConfigError(f"unknown dtype {m.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.schedule not in ALL_SCHEDULES:
            raise ParallelConfigError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(ALL_SCHEDULES)}")
        if self.schedule in ZERO_BUBBLE_SCHEDULES:
            check_zero_bubble(self.schedule, self.pp, self.microbatches, m.num_layers)
        if self.distributed_optimizer and self.dp == 1:
            raise ParallelConfigError(
                "the distributed optimizer shards the optimizer state over the data-parallel "
                "group, but dp is 1: nothing to shard; raise --dp or use "
                "--dp-sharding replicate"
            )
        if self.shard_gradients and not self.distributed_optimizer:
            raise ParallelConfigError("ZeRO-2 keeps the distributed optimizer's gradient shards: it needs it")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ParallelConfigError(f"bucket size {self.bucket_size} must be a positive number of bytes")
        if self.virtual_stages != 1:
            if self.schedule != "1f1b":
                raise ParallelConfigError(f"{self.virtual_stages} virtual stages need the 1f1b schedule")
            check_virtual_pipeline(m.num_layers, self.pp, self.virtual_stages, self.microbatches)
        if self.fsdp2 or self.dp_replicate != 1:
            self._check_fsdp2()
        if self.order not in ORDERS:
            raise ParallelConfigError(f"unknown order {self.order!r}; choose one of {', '.join(ORDERS)}")

    @property
    def chunks(self) -> int:
        """Model chunks per rank: v under interleaving, 2 in a V (zbv, dualpipev), else 1."""
        if self.schedule in ZERO_BUBBLE_SCHEDULES:
            return len(stages_of(self.schedule, self.pp, 0))
        return self.virtual_stages

    def _check_fsdp2(self) -> None:
        """One-line refusals of an FSDP2 or HSDP setup the reference cannot run (the demo's, where it has them)."""
        if not self.fsdp2:
            raise ParallelConfigError(f"--dp-replicate {self.dp_replicate} is HSDP's; add --dp-sharding fsdp2")
        if self.pp > 1 or self.microbatches > 1:
            raise ParallelConfigError(
                f"--dp-sharding fsdp2 needs --pp 1 and --micro-batches 1 (got --pp {self.pp} --micro-batches "
                f"{self.microbatches}): the reference FSDP2 has no no_sync, so it cannot accumulate gradients over "
                "micro-batches and reduce-scatter once"
            )
        if self.distributed_optimizer:
            raise ParallelConfigError("--dp-sharding is fsdp2 or optimizer, not both")
        if self.dp == 1:
            raise ParallelConfigError("FSDP2 shards over the data-parallel group, but dp is 1: nothing to shard")
        if self.dp_replicate < 1 or self.dp % self.dp_replicate:
            raise ParallelConfigError(f"--dp-replicate {self.dp_replicate} does not divide dp {self.dp}")

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is sharded over: the DP group, or under HSDP one replica's share of it."""
        return self.dp // self.dp_replicate

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def sequence_parallel(self) -> bool:
        """SP as the layers apply it: off at tp 1, as in Megatron."""
        return self.sp and self.tp > 1

    @property
    def params_dtype(self) -> torch.dtype:
        return DTYPES[self.model.dtype]

    @property
    def dtype_bytes(self) -> int:
        return self.params_dtype.itemsize

    @property
    def padded_vocab_size(self) -> int:
        """V padded to a multiple of tp, as the vocab-parallel layers pad it."""
        return pad_vocab_size(self.model.vocab_size, self.tp)

    def to_dict(self) -> dict:
        """The fields, less FSDP2's and ZeRO-2's at their defaults: a trace recorded before they existed still
        reads back."""
        fields = {**dataclasses.asdict(self), "model": self.model.to_dict()}
        if not self.shard_gradients:
            del fields["shard_gradients"]
        if not self.fsdp2:
            del fields["fsdp2"], fields["dp_replicate"]
        return fields


def setup_for(model: str, **layout) -> ScaleSetup:
    """ScaleSetup for a preset by name (a one-line error for an unknown or renamed name)."""
    return ScaleSetup(shape_named(model), **layout)


# Long-context shapes for the CP rows (reference.measure.scale.cp_report): Llama-3-405B's layers, width, heads and
# FFN at its 128K context; multi-head K/V, as the reference GPT has (Llama 3 shares each K/V head among 16 query
# heads: its K/V bytes are 1/16 of these).
CP_MODELS = {"405b": ModelShape("405b", 126, 16384, 128, 53248, 128256, 131072)}


@dataclasses.dataclass(frozen=True)
class CPSetup:
    """One layer's causal ring attention (reference.context_parallel.ring_attention), forward and backward, on
    one rank of a tp x cp x pp x dp job: its shard holds s / cp tokens of heads / tp heads (head-tail balanced:
    2 cp chunks, so 2 cp divides s)."""

    model: ModelShape
    tp: int
    cp: int
    pp: int = 1
    dp: int = 1
    balanced: bool = True

    def __post_init__(self) -> None:
        m = self.model
        if min(self.tp, self.cp, self.pp, self.dp) < 1:
            raise ParallelConfigError(f"tp {self.tp}, cp {self.cp}, pp {self.pp} and dp {self.dp} must be >= 1")
        if self.pp > m.num_layers:
            raise ParallelConfigError(f"{self.pp} pipeline stages but only {m.num_layers} layers")
        divide(m.num_attention_heads, self.tp, "num_attention_heads")
        divide(m.hidden_size, m.num_attention_heads, "hidden_size", by="num_attention_heads")
        chunks = 2 * self.cp if self.balanced else self.cp
        divide(m.seq_length, chunks, "the sequence length", by=f"2 x cp ({chunks} chunks, head-tail balanced)")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shard_shape(self) -> tuple[int, int, int, int]:
        """[b, heads / tp, s / cp, head dim]: this rank's q (and k, v)."""
        m = self.model
        heads = m.num_attention_heads
        return m.micro_batch_size, heads // self.tp, m.seq_length // self.cp, m.hidden_size // heads

    @property
    def params_dtype(self) -> torch.dtype:
        return DTYPES[self.model.dtype]


def cp_setup_for(model: str, **layout) -> CPSetup:
    """CPSetup for a preset of MODELS or CP_MODELS by name (a one-line error for an unknown name, and for a
    grouped-query preset: the reference repeats K/V to the query heads before the ring,
    reference.tensor_parallel.transformer.causal, so its CP rows would be the multi-head ones)."""
    shape = shape_named(model, {**MODELS, **CP_MODELS})
    if shape.kv_heads != shape.num_attention_heads:
        raise ParallelConfigError(
            f"--cp with {model}: the reference ring sends K/V repeated to all {shape.num_attention_heads} query heads, "
            f"not {shape.kv_heads} key/value heads, so these rows would not be {model}'s; use --model 405b (multi-head)"
        )
    return CPSetup(shape, **layout)

"""A small decoder, unsharded and as one pipeline stage of a TP x PP split; any split has the same weights.

One family, two block styles (GPTConfig.style): "gpt2" (LayerNorm, GELU MLP, learned positions, multi-head
attention with biases) and "llama" (the Llama/Qwen2 block: RMSNorm, SwiGLU MLP without biases, rotary
positions, grouped-query attention with num_kv_heads key/value heads and q/k/v biases as Qwen2 has them).
reference/gpt/hf_weights.py maps a Hugging Face Qwen2ForCausalLM's weights onto the "llama" style.

Layout (Megatron's names, megatron/core/models/gpt/gpt_model.py::GPTModel): `embedding` (word + learned
position embeddings, megatron/core/models/common/embeddings/language_model_embedding.py::
LanguageModelEmbedding), `layers` (pre-LayerNorm blocks), `final_layernorm`, `output_layer` (untied, no bias).
Activations are [s, b, h]. The loss is the mean token cross-entropy of `labels` (the caller shifts the tokens:
inputs = tokens[:, :-1], labels = tokens[:, 1:]), so a batch's loss is the mean over its b x s tokens.

A pipeline stage holds consecutive layers [first_layer, last_layer); the first stage also holds the embedding
(Megatron's `pre_process`), the last the final LayerNorm and output layer (`post_process`),
megatron/core/transformer/transformer_block.py::TransformerBlock builds `final_layernorm` only when
post_process. Under sequence parallelism the stage boundary carries [s / tp, b, h]: the first stage scatters
the embeddings along the sequence (as LanguageModelEmbedding.forward does when learned position embeddings
are added), the last gathers inside the output layer.

Initialization: every module is drawn from its own seed, `seed + index` (0: embedding, 1..L: layer i - 1,
L + 1: head), with the caller's RNG stream restored afterwards. A stage draws exactly the master weights
the unsharded model has for its modules without drawing the others, so every TP x PP split of the same seed
is the same model. (Megatron-LM instead seeds each pipeline rank differently, seed + 100 * pp_rank, in
megatron/training/initialize.py::_set_random_seed, so its weights depend on the PP size.)

Sequence parallelism with rotary positions ("llama") accepts a sequence length the TP size does not divide:
the stage pads tokens and labels at the end, the positions simply continue (causal attention keeps real
tokens blind to the pad), and the loss is the mean over the real labels only (the pad labels are dropped
before the mean, as an ignore index would), so it equals the unpadded loss. Learned positions ("gpt2") have
one row per position and refuse instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.parallel_state import ParallelConfigError, ParallelLayout, divide
from reference.pipeline.interleaved import check_interleaving
from reference.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from reference.tensor_parallel.parallelize import parallelize_block, split_query_groups
from reference.tensor_parallel.random import TensorParallelRNG
from reference.tensor_parallel.rotary import rotary_cos_sin
from reference.tensor_parallel.transformer import Block, LlamaBlock, TransformerBlock, init_method_normal
from reference.tensor_parallel.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

STYLES = ("gpt2", "llama")
SIZES = ("vocab_size", "hidden_size", "num_attention_heads", "num_layers", "seq_length")  # GPTConfig.from_sizes


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_layers: int = 2
    seq_length: int = 16
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    # one matrix embeds the tokens and produces the logits (Megatron's default is True; here False, so that
    # the untied runs and traces keep their meaning); across stages see reference.pipeline.tied_embeddings
    share_embeddings_and_output_weights: bool = False
    style: str = "gpt2"  # the block: "gpt2" or "llama" (see the module docstring)
    num_kv_heads: int | None = None  # "llama": key/value heads (query groups); default num_attention_heads
    rope_theta: float = 1_000_000.0  # "llama": rotary base (Qwen2.5's rope_theta)
    norm_eps: float = 1e-6  # "llama": RMSNorm epsilon (Qwen2's rms_norm_eps)

    @classmethod
    def from_sizes(cls, source, **fields) -> GPTConfig:
        """The config of `source`'s sizes, its attributes named as SIZES (a CLI's parsed --vocab-size,
        --hidden-size, --num-attention-heads, --num-layers and --seq-length, or a scale ModelShape), and `fields`."""
        return cls(**{name: getattr(source, name) for name in SIZES}, **fields)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ParallelConfigError(f"unknown model style {self.style!r}; choose one of {', '.join(STYLES)}")
        if self.style == "llama":
            if self.num_attention_heads % self.kv_heads:
                raise ParallelConfigError(
                    f"{self.num_attention_heads} attention heads do not split into "
                    f"{self.kv_heads} key/value heads' groups of equal size"
                )
            if self.hidden_dropout or self.attention_dropout:
                raise ParallelConfigError(
                    "the llama style has no dropout (as Llama and Qwen2 pretraining); use --dropout 0"
                )
            if (self.hidden_size // max(self.num_attention_heads, 1)) % 2:
                raise ParallelConfigError(
                    "rotary positions rotate pairs: the head dimension hidden_size / num_attention_heads must be even"
                )
        elif self.num_kv_heads not in (None, self.num_attention_heads):
            raise ParallelConfigError("grouped-query attention (num_kv_heads) needs the llama style")
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_layers", "seq_length"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ParallelConfigError(f"GPTConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        divide(self.hidden_size, self.num_attention_heads, "hidden_size", by="num_attention_heads")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ParallelConfigError(f"GPTConfig.ffn_hidden_size must be positive, got {self.ffn_hidden_size}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ParallelConfigError(f"GPTConfig.{name} must be in [0, 1), got {getattr(self, name)}")

    def block_kwargs(self) -> dict:
        if self.style == "llama":
            return dict(
                num_kv_heads=self.kv_heads,
                ffn_hidden_size=self.ffn_hidden_size or 4 * self.hidden_size,
                norm_eps=self.norm_eps,
                init_method=init_method_normal(self.init_std),
            )
        return dict(
            ffn_hidden_size=self.ffn_hidden_size,
            init_method=init_method_normal(self.init_std),
            hidden_dropout=self.hidden_dropout,
            attention_dropout=self.attention_dropout,
        )

    def block(self, params_dtype: torch.dtype = torch.float32, device=None) -> Block:
        """One plain block of this style (reference.tensor_parallel.transformer)."""
        make = LlamaBlock if self.style == "llama" else TransformerBlock
        return make(
            self.hidden_size, self.num_attention_heads, params_dtype=params_dtype, device=device, **self.block_kwargs()
        )

    def parallel_block(
        self, tp_group: dist.ProcessGroup, *, params_dtype: torch.dtype = torch.float32, device=None, **options
    ) -> Block:
        """One block of this style split over `tp_group`; `options` (sequence_parallel, rng, recompute, ...) go
        to reference.tensor_parallel.parallelize.parallelize_block."""
        return parallelize_block(self.block(params_dtype, device), tp_group, **options)

    def final_norm(self, **kw) -> torch.nn.Module:
        if self.style == "llama":
            return torch.nn.RMSNorm(self.hidden_size, eps=self.norm_eps, **kw)
        return torch.nn.LayerNorm(self.hidden_size, **kw)

    def rotary(self, seq_length: int, device) -> tuple[torch.Tensor, ...]:
        """The extra block arguments: cos, sin of the whole sequence for "llama" (built once, rotary_cos_sin
        caches them), none for "gpt2"."""
        if self.style == "llama":
            return rotary_cos_sin(seq_length, self.head_dim, self.rope_theta, device)
        return ()


def check_tensor_parallel(config: GPTConfig, tp: int, sequence_parallel: bool) -> None:
    """One-line refusals of a TP size the model cannot be split by, before any process group is used."""
    if config.style == "llama":
        split_query_groups(config.num_attention_heads, config.kv_heads, tp)
    else:
        divide(config.num_attention_heads, tp, "num_attention_heads", by="the tensor-parallel size")
    if sequence_parallel and tp > 1:
        if config.seq_length < tp:
            raise ParallelConfigError(
                f"sequence length {config.seq_length} is shorter than the tensor-parallel "
                f"size {tp}: sequence parallelism would leave a rank without tokens"
            )
        if config.style == "gpt2":
            divide(config.seq_length, tp, "the sequence length", by="the tensor-parallel size (sequence parallel)")


def padded_seq_length(config: GPTConfig, tp: int, sequence_parallel: bool) -> int:
    """The sequence length the stage runs: under SP, rounded up to a multiple of tp (see the module docstring)."""
    if not (sequence_parallel and tp > 1):
        return config.seq_length
    return -(-config.seq_length // tp) * tp


def split_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """[first, last) layers of each of `pp_size` stages: consecutive, sizes differing by at most one (the
    earlier stages take the extra layers). Megatron requires num_layers divisible by the PP size
    (megatron/core/transformer/transformer_block.py::get_num_layers_to_build); uneven splits are allowed here.

    Mirrors `megatron-lm:megatron/core/transformer/transformer_block.py::get_num_layers_to_build`.
    """
    if pp_size < 1:
        raise ParallelConfigError(f"the pipeline needs at least 1 stage, got {pp_size}")
    if pp_size > num_layers:
        raise ParallelConfigError(
            f"{pp_size} pipeline stages need at least {pp_size} transformer layers, "
            f"the model has {num_layers}; lower --pp or raise --num-layers"
        )
    base, extra = divmod(num_layers, pp_size)
    bounds, first = [], 0
    for stage in range(pp_size):
        last = first + base + (stage < extra)
        bounds.append((first, last))
        first = last
    return bounds


@contextlib.contextmanager
def module_seed(seed: int, index: int) -> Iterator[None]:
    """Draw one module's weights from seed + index (CPU stream: master weights are built on the CPU), leaving
    the caller's stream as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + index)
        yield


def _embedding_weight(rows: int, config: GPTConfig) -> torch.Tensor:
    master = torch.empty(rows, config.hidden_size)
    init_method_normal(config.init_std)(master)
    return master


class UnshardedGPT(torch.nn.Module):
    """The whole model in plain PyTorch on one process: the oracle of every TP x PP x DP run, and the model
    the FSDP demo, tests, trace and benchmark shard, one unit per layer (reference/fsdp/units.py)."""

    def __init__(self, config: GPTConfig, seed: int, device=None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        with module_seed(seed, 0):
            self.embedding = torch.nn.Module()
            self.embedding.word_embeddings = torch.nn.Embedding.from_pretrained(
                _embedding_weight(config.vocab_size, config), freeze=False
            )
            if config.style == "gpt2":
                self.embedding.position_embeddings = torch.nn.Embedding.from_pretrained(
                    _embedding_weight(config.seq_length, config), freeze=False
                )
        self.layers = torch.nn.ModuleList()
        for i in range(config.num_layers):
            with module_seed(seed, 1 + i):
                self.layers.append(config.block(device="cpu"))
        with module_seed(seed, 1 + config.num_layers):
            self.final_layernorm = config.final_norm()
            self.output_layer = torch.nn.utils.skip_init(torch.nn.Linear, h, config.vocab_size, bias=False)
            if config.share_embeddings_and_output_weights:
                self.output_layer.weight = self.embedding.word_embeddings.weight
            else:
                with torch.no_grad():
                    self.output_layer.weight.copy_(_embedding_weight(config.vocab_size, config))
        self.to(device)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> logits [s, b, V]."""
        x = self.embedding.word_embeddings(tokens)
        if self.config.style == "gpt2":
            x = x + self.embedding.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        x = x.transpose(0, 1)  # [b, s, h] -> [s, b, h]
        extra = self.config.rotary(x.shape[0], x.device)
        for layer in self.layers:
            x = layer(x, *extra)
        return self.output_layer(self.final_layernorm(x))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """tokens, labels [b, s] -> mean token cross-entropy."""
        logits = self.logits(tokens)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.transpose(0, 1).flatten())


class GPTStage(torch.nn.Module):
    """Layers [first_layer, last_layer) of the GPT, tensor-parallel over `tp_group`, plus the embedding on the
    first stage and the final LayerNorm + vocab-parallel head and loss on the last.

    forward(hidden, tokens, labels): the first stage ignores `hidden` and embeds `tokens` [b, s]; other stages
    take `hidden` from the previous stage, [s, b, h] ([s / tp, b, h] under sequence parallelism, s padded to a
    multiple of tp for "llama"). The last stage returns the micro-batch's mean token loss over its real labels
    (a scalar, equal on every TP rank), the others the hidden state to send on. `block_kwargs` go to every
    block (reference.tensor_parallel.parallelize.parallelize_block, e.g. async_grad_allreduce).
    `params_dtype` is every parameter's dtype (the weights are drawn in fp32 and rounded, as in Megatron).

    Mirrors `megatron-lm:megatron/core/models/gpt/gpt_model.py::GPTModel`.
    """

    def __init__(
        self,
        config: GPTConfig,
        tp_group: dist.ProcessGroup,
        *,
        first_layer: int,
        last_layer: int,
        is_first: bool,
        is_last: bool,
        sequence_parallel: bool = False,
        seed: int = 1234,
        device=None,
        params_dtype: torch.dtype = torch.float32,
        **block_kwargs,
    ):
        super().__init__()
        if not 0 <= first_layer <= last_layer <= config.num_layers:
            raise ParallelConfigError(
                f"layers [{first_layer}, {last_layer}) are outside the model's {config.num_layers} layers"
            )
        tp = tp_group.size()
        self.config, self.tp_group, self.params_dtype = config, tp_group, params_dtype
        self.first_layer, self.last_layer, self.is_first, self.is_last = first_layer, last_layer, is_first, is_last
        self.sequence_parallel = sequence_parallel and tp > 1
        check_tensor_parallel(config, tp, self.sequence_parallel)
        self.seq_length = padded_seq_length(config, tp, self.sequence_parallel)
        init = init_method_normal(config.init_std)
        if is_first:
            with module_seed(seed, 0):
                self.embedding = torch.nn.Module()
                self.embedding.word_embeddings = VocabParallelEmbedding(
                    config.vocab_size,
                    config.hidden_size,
                    tp_group=tp_group,
                    init_method=init,
                    params_dtype=params_dtype,
                    device=device,
                )
                if config.style == "gpt2":
                    self.embedding.position_embeddings = torch.nn.Embedding.from_pretrained(
                        _embedding_weight(config.seq_length, config).to(device, params_dtype), freeze=False
                    )
        block_kwargs = {**block_kwargs, "rng": TensorParallelRNG(seed, tp_group, device)}
        self.layers = torch.nn.ModuleList()
        for i in range(first_layer, last_layer):
            with module_seed(seed, 1 + i):
                self.layers.append(
                    config.parallel_block(
                        tp_group,
                        sequence_parallel=self.sequence_parallel,
                        params_dtype=params_dtype,
                        device=device,
                        **block_kwargs,
                    )
                )
        if is_last:
            with module_seed(seed, 1 + config.num_layers):
                self.final_layernorm = config.final_norm(dtype=params_dtype, device=device)
                self.output_layer = ParallelLMHead(
                    config.hidden_size,
                    config.vocab_size,
                    tp_group=tp_group,
                    init_method=init,
                    sequence_parallel=self.sequence_parallel,
                    params_dtype=params_dtype,
                    device=device,
                )
            for param in self.final_layernorm.parameters():  # sees only local tokens under SP: partial grads
                param.sequence_parallel = self.sequence_parallel
            if config.share_embeddings_and_output_weights and is_first:  # one stage: one Parameter
                self.output_layer.output_layer.weight = self.embedding.word_embeddings.weight

    def activation_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        """Shape of the hidden state sent between stages (megatron/core/pipeline_parallel/schedules.py::
        get_tensor_shapes: the sequence divided by TP under sequence parallelism)."""
        s = self.seq_length // (self.tp_group.size() if self.sequence_parallel else 1)
        return (s, micro_batch_size, self.config.hidden_size)

    def _pad(self, ids: torch.Tensor, value: int) -> torch.Tensor:
        """[b, s] -> [b, self.seq_length]: the sequence-parallel padding at the end (see the module docstring)."""
        pad = self.seq_length - ids.shape[1]
        return F.pad(ids, (0, pad), value=value) if pad else ids

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] != self.config.seq_length:
            raise ParallelConfigError(
                f"tokens have sequence length {tokens.shape[1]}, the model {self.config.seq_length}"
            )
        tokens = self._pad(tokens, 0)
        x = self.embedding.word_embeddings(tokens)
        if self.config.style == "gpt2":
            x = x + self.embedding.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        hidden = x.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.sequence_parallel:
            hidden = scatter_to_sequence_parallel_region(hidden, self.tp_group)
        return hidden

    def _layers(self, hidden: torch.Tensor) -> torch.Tensor:
        extra = self.config.rotary(self.seq_length, hidden.device)
        for layer in self.layers:
            hidden = layer(hidden, *extra)
        return hidden

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """A single-stage model's logits, this rank's vocabulary columns [s, b, V_p / tp] (padded s under SP)."""
        return self.output_layer.logits(self.final_layernorm(self._layers(self._embed(tokens))))

    def forward(self, hidden: torch.Tensor | None, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mirrors `megatron-lm:megatron/core/models/gpt/gpt_model.py::GPTModel.forward`."""
        if self.is_first:
            hidden = self._embed(tokens)
        hidden = self._layers(hidden)
        if not self.is_last:
            return hidden
        hidden = self.final_layernorm(hidden)
        if labels.shape[1] == self.seq_length:
            return self.output_layer(hidden, labels).mean()
        real = labels.shape[1]  # padded under SP: the pad positions get id 0 and leave the mean
        return self.output_layer(hidden, self._pad(labels, 0))[:, :real].mean()


def _stages(config: GPTConfig, layout: ParallelLayout, bounds: list[tuple[int, int]], **stage_kwargs) -> list[GPTStage]:
    """A GPTStage per [first, last) layer range, tensor-parallel over the layout's TP group; the one holding
    layer 0 embeds, the one holding the last layer computes the loss."""
    return [
        GPTStage(
            config,
            layout.tp_group,
            first_layer=first,
            last_layer=last,
            is_first=first == 0,
            is_last=last == config.num_layers,
            **stage_kwargs,
        )
        for first, last in bounds
    ]


def build_stage(config: GPTConfig, layout: ParallelLayout, **stage_kwargs) -> GPTStage:
    """This rank's stage: its PP rank's share of split_layers, tensor-parallel over its TP group. `stage_kwargs`
    go to GPTStage (sequence_parallel, seed, device, params_dtype, block arguments)."""
    (stage,) = _stages(
        config, layout, [split_layers(config.num_layers, layout.pp_size)[layout.pp_rank]], **stage_kwargs
    )
    return stage


def split_virtual_stages(num_layers: int, pp_size: int, virtual_stages: int) -> list[list[tuple[int, int]]]:
    """[first, last) layers of each chunk of each stage for interleaved 1F1B: the layers cut into p * v equal
    virtual stages, chunk c of PP rank r being virtual stage c * p + r (megatron/core/transformer/
    transformer_layer.py::get_transformer_layer_offset), so a micro-batch visits every rank v times. Megatron
    refuses layer counts that p * v does not divide (megatron/core/transformer/transformer_config.py::
    TransformerConfig.__post_init__: layers per stage divisible by the virtual size).

    Mirrors `megatron-lm:megatron/core/transformer/transformer_layer.py::get_transformer_layer_offset`.
    """
    p, v = pp_size, virtual_stages
    if p < 1 or v < 1:
        raise ParallelConfigError(f"pipeline and virtual stages must be at least 1, got pp {p} and {v}")
    if num_layers % (p * v):
        raise ParallelConfigError(
            f"{num_layers} transformer layers do not split into pp {p} x {v} virtual stages "
            f"of equal size; use a multiple of {p * v} layers"
        )
    per_chunk = num_layers // (p * v)
    return [[((c * p + r) * per_chunk, (c * p + r + 1) * per_chunk) for c in range(v)] for r in range(p)]


def check_virtual_pipeline(num_layers: int, pp_size: int, virtual_stages: int, micro_batches: int) -> None:
    """megatron-core's refusals of an interleaved pipeline, each one line: layers that do not cut into pp x v
    equal chunks (split_virtual_stages), fewer than 2 stages or micro-batches not a multiple of pp
    (reference.pipeline.interleaved.check_interleaving)."""
    split_virtual_stages(num_layers, pp_size, virtual_stages)
    check_interleaving(pp_size, virtual_stages, micro_batches)


def build_chunks(config: GPTConfig, layout: ParallelLayout, virtual_stages: int, **stage_kwargs) -> list[GPTStage]:
    """This rank's v model chunks for interleaved 1F1B (split_virtual_stages), tensor-parallel over its TP group."""
    bounds = split_virtual_stages(config.num_layers, layout.pp_size, virtual_stages)[layout.pp_rank]
    return _stages(config, layout, bounds, **stage_kwargs)

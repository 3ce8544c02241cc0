"""The decoder in plain PyTorch, whole or as one pipeline stage's layers; the model file never mentions ranks.

`GPT` is Megatron's layout: `embedding` (word and, for "gpt2", learned position embeddings), pre-norm
`layers`, `final_layernorm`, `output_layer` with the loss. Activations are [s, b, h]; the loss is the mean
token cross-entropy of `labels`. Two block styles (GPTConfig.style): "gpt2" and "llama" (the Llama/Qwen2
block). A stage keeps only its layers [first, last), the embedding when it holds layer 0, the head when it
holds the last. Each module draws from its own seed (module_seed), so every split of one seed is the same
model. Unchanged, a GPT is the oracle and the model FSDP shards; reference.gpt.parallelize splits it over TP.

Mirrors `megatron-lm:megatron/core/models/gpt/gpt_model.py::GPTModel`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from reference.parallel_state import ParallelConfigError, divide
from reference.tensor_parallel.rotary import rotary_cos_sin
from reference.tensor_parallel.transformer import Block, LlamaBlock, TransformerBlock, init_method_normal
from reference.tensor_parallel.vocab_parallel import LMHead

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
    qkv_bias: bool = True  # "llama": Qwen2's q/k/v biases; False: none, as Llama 3 (HF's attention_bias=False)

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
        elif not self.qkv_bias:
            raise ParallelConfigError("a bias-free QKV (qkv_bias False) needs the llama style")
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
                qkv_bias=self.qkv_bias,
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


def _from_pretrained(weight: torch.Tensor, dtype, device) -> torch.nn.Embedding:
    return torch.nn.Embedding.from_pretrained(weight.to(device, dtype), freeze=False)


class Embedding(torch.nn.Module):
    """tokens [b, s] -> word (+ learned position, "gpt2") embeddings, sequence-first [s, b, h]: Megatron's
    LanguageModelEmbedding (megatron/core/models/common/embeddings/language_model_embedding.py)."""

    def __init__(self, config: GPTConfig, dtype, device):
        super().__init__()
        self.word_embeddings = _from_pretrained(_embedding_weight(config.vocab_size, config), dtype, device)
        self.position_embeddings = None
        if config.style == "gpt2":
            self.position_embeddings = _from_pretrained(_embedding_weight(config.seq_length, config), dtype, device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: the position ids of the tokens held (context parallelism), default 0..s-1."""
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            at = torch.arange(tokens.shape[1]) if positions is None else positions
            x = x + self.position_embeddings(at.to(tokens.device))
        return x.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]


class GPT(torch.nn.Module):
    """Layers [first, last) of `layers` (default: all), with the embedding on the stage holding layer 0
    (Megatron's pre_process) and the final norm and head on the one holding the last (post_process).

    forward(tokens, labels, hidden=None): the first stage embeds `tokens`, the others take the previous stage's
    `hidden`; the last returns the mean token loss, the others the hidden state to send on. Parameters are
    `params_dtype`, drawn in fp32 and rounded, as in Megatron.

    Mirrors `megatron-lm:megatron/core/models/gpt/gpt_model.py::GPTModel`.
    """

    def __init__(
        self,
        config: GPTConfig,
        seed: int = 1234,
        device=None,
        *,
        layers: tuple[int, int] | None = None,
        params_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        first, last = layers or (0, config.num_layers)
        if not 0 <= first <= last <= config.num_layers:
            raise ParallelConfigError(f"layers [{first}, {last}) are outside the model's {config.num_layers} layers")
        self.config, self.params_dtype = config, params_dtype
        self.first_layer, self.last_layer = first, last
        self.is_first, self.is_last = first == 0, last == config.num_layers
        self.seq_length, self.seq_shards = config.seq_length, 1  # parallelize: padded, split over TP under SP
        self.positions = None  # parallelize, under CP: the position ids of this rank's tokens (None: 0..s-1)
        if self.is_first:
            with module_seed(seed, 0):
                self.embedding = Embedding(config, params_dtype, device)
        self.layers = torch.nn.ModuleList()
        for i in range(first, last):
            with module_seed(seed, 1 + i):
                self.layers.append(config.block(params_dtype, device))
        if self.is_last:
            with module_seed(seed, 1 + config.num_layers):
                self.final_layernorm = config.final_norm(dtype=params_dtype, device=device)
                init = init_method_normal(config.init_std)
                self.output_layer = LMHead(
                    config.hidden_size, config.vocab_size, init_method=init, params_dtype=params_dtype, device=device
                )
            if config.share_embeddings_and_output_weights and self.is_first:  # across stages: pipeline.tied_embeddings
                self.output_layer.weight = self.embedding.word_embeddings.weight

    def activation_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        """Shape of the hidden state sent between stages (megatron/core/pipeline_parallel/schedules.py::
        get_tensor_shapes: the sequence divided by TP under sequence parallelism)."""
        held = self.seq_length if self.positions is None else len(self.positions)
        return (held // self.seq_shards, micro_batch_size, self.config.hidden_size)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        held = self.config.seq_length if self.positions is None else len(self.positions)
        if tokens.shape[1] != held:
            raise ParallelConfigError(f"tokens have sequence length {tokens.shape[1]}, the model {held}")
        return self.embedding(tokens, self.positions)

    def _layers(self, hidden: torch.Tensor) -> torch.Tensor:
        rotary = self.config.rotary(self.seq_length, hidden.device)
        if self.positions is not None:  # context parallelism: the rows of the positions held
            rotary = tuple(table[self.positions.to(hidden.device)] for table in rotary)
        for layer in self.layers:
            hidden = layer(hidden, *rotary)
        return hidden

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """A whole model's logits [s, b, V] (parallelized: this rank's vocabulary columns, the padded s under SP)."""
        return self.output_layer.logits(self.final_layernorm(self._layers(self._embed(tokens))))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Mirrors `megatron-lm:megatron/core/models/gpt/gpt_model.py::GPTModel.forward`."""
        if self.is_first:
            hidden = self._embed(tokens)
        hidden = self._layers(hidden)
        if not self.is_last:
            return hidden
        return self.output_layer(self.final_layernorm(hidden), labels).mean()


def gpt_blocks(num_layers: int, hidden_size: int, heads: int, *, seed: int = 1234, device=None, **fields) -> GPT:
    """The GPT without its ends, as a middle pipeline stage holds it: `num_layers` GPT-2 blocks, no embedding and
    no head, [s, b, h] in and out (`model(None, None, hidden=x)`): what block-level tests and benchmarks feed
    hidden states. `fields`: GPTConfig's (ffn_hidden_size, hidden_dropout, attention_dropout) and params_dtype."""
    dtype = fields.pop("params_dtype", torch.float32)
    config = GPTConfig(hidden_size=hidden_size, num_attention_heads=heads, num_layers=num_layers + 2, **fields)
    return GPT(config, seed, device, layers=(1, num_layers + 1), params_dtype=dtype)


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

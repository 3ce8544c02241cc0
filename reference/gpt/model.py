"""A small GPT, unsharded and as one pipeline stage of a TP x PP split; any split has the same weights.

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
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.parallel_state import ParallelConfigError, ParallelLayout, divide
from reference.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from reference.tensor_parallel.random import TensorParallelRNG
from reference.tensor_parallel.transformer import ParallelTransformerBlock
from reference.tensor_parallel.unsharded import TransformerBlock, init_method_normal
from reference.tensor_parallel.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


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

    def __post_init__(self) -> None:
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
        return dict(ffn_hidden_size=self.ffn_hidden_size, init_method=init_method_normal(self.init_std),
                    hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout)


def split_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """[first, last) layers of each of `pp_size` stages: consecutive, sizes differing by at most one (the
    earlier stages take the extra layers). Megatron requires num_layers divisible by the PP size
    (megatron/core/transformer/transformer_block.py::get_num_layers_to_build); uneven splits are allowed here.

    Mirrors `megatron-lm:megatron/core/transformer/transformer_block.py::get_num_layers_to_build`.
    """
    if pp_size < 1:
        raise ParallelConfigError(f"the pipeline needs at least 1 stage, got {pp_size}")
    if pp_size > num_layers:
        raise ParallelConfigError(f"{pp_size} pipeline stages need at least {pp_size} transformer layers, "
                                  f"the model has {num_layers}; lower --pp or raise --num-layers")
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
    """The whole model in plain PyTorch on one process: the oracle of every TP x PP x DP run."""

    def __init__(self, config: GPTConfig, seed: int, device=None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        with module_seed(seed, 0):
            self.embedding = torch.nn.Module()
            self.embedding.word_embeddings = torch.nn.Embedding.from_pretrained(
                _embedding_weight(config.vocab_size, config), freeze=False)
            self.embedding.position_embeddings = torch.nn.Embedding.from_pretrained(
                _embedding_weight(config.seq_length, config), freeze=False)
        self.layers = torch.nn.ModuleList()
        for i in range(config.num_layers):
            with module_seed(seed, 1 + i):
                self.layers.append(TransformerBlock(h, config.num_attention_heads, device="cpu",
                                                    **config.block_kwargs()))
        with module_seed(seed, 1 + config.num_layers):
            self.final_layernorm = torch.nn.LayerNorm(h)
            self.output_layer = torch.nn.utils.skip_init(torch.nn.Linear, h, config.vocab_size, bias=False)
            if config.share_embeddings_and_output_weights:
                self.output_layer.weight = self.embedding.word_embeddings.weight
            else:
                with torch.no_grad():
                    self.output_layer.weight.copy_(_embedding_weight(config.vocab_size, config))
        self.to(device)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """tokens, labels [b, s] -> mean token cross-entropy."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding.word_embeddings(tokens) + self.embedding.position_embeddings(positions)
        x = x.transpose(0, 1)  # [b, s, h] -> [s, b, h]
        for layer in self.layers:
            x = layer(x)
        logits = self.output_layer(self.final_layernorm(x))  # [s, b, V]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.transpose(0, 1).flatten())


class GPTStage(torch.nn.Module):
    """Layers [first_layer, last_layer) of the GPT, tensor-parallel over `tp_group`, plus the embedding on the
    first stage and the final LayerNorm + vocab-parallel head and loss on the last.

    forward(hidden, tokens, labels): the first stage ignores `hidden` and embeds `tokens` [b, s]; other stages
    take `hidden` from the previous stage, [s, b, h] ([s / tp, b, h] under sequence parallelism). The last
    stage returns the micro-batch's mean token loss (a scalar, equal on every TP rank), the others the hidden
    state to send on. `block_kwargs` go to every ParallelTransformerBlock (e.g. async_grad_allreduce).
    `params_dtype` is every parameter's dtype (the weights are drawn in fp32 and rounded, as in Megatron).

    Mirrors `megatron-lm:megatron/core/models/gpt/gpt_model.py::GPTModel`.
    """

    def __init__(self, config: GPTConfig, tp_group: dist.ProcessGroup, *, first_layer: int, last_layer: int,
                 is_first: bool, is_last: bool, sequence_parallel: bool = False, seed: int = 1234,
                 device=None, params_dtype: torch.dtype = torch.float32, **block_kwargs):
        super().__init__()
        if not 0 <= first_layer <= last_layer <= config.num_layers:
            raise ParallelConfigError(f"layers [{first_layer}, {last_layer}) are outside the model's "
                                      f"{config.num_layers} layers")
        tp = tp_group.size()
        self.config, self.tp_group, self.params_dtype = config, tp_group, params_dtype
        self.first_layer, self.last_layer, self.is_first, self.is_last = first_layer, last_layer, is_first, is_last
        self.sequence_parallel = sequence_parallel and tp > 1
        if self.sequence_parallel:
            divide(config.seq_length, tp, "the sequence length", by="the tensor-parallel size (sequence parallel)")
        init = init_method_normal(config.init_std)
        if is_first:
            with module_seed(seed, 0):
                self.embedding = torch.nn.Module()
                self.embedding.word_embeddings = VocabParallelEmbedding(
                    config.vocab_size, config.hidden_size, tp_group=tp_group, init_method=init,
                    params_dtype=params_dtype, device=device)
                self.embedding.position_embeddings = torch.nn.Embedding.from_pretrained(
                    _embedding_weight(config.seq_length, config).to(device, params_dtype), freeze=False)
        rng = TensorParallelRNG(seed, tp_group, device)
        self.layers = torch.nn.ModuleList()
        for i in range(first_layer, last_layer):
            with module_seed(seed, 1 + i):
                self.layers.append(ParallelTransformerBlock(
                    config.hidden_size, config.num_attention_heads, tp_group=tp_group,
                    sequence_parallel=self.sequence_parallel, params_dtype=params_dtype, device=device, rng=rng,
                    **{**config.block_kwargs(), **block_kwargs}))
        if is_last:
            with module_seed(seed, 1 + config.num_layers):
                self.final_layernorm = torch.nn.LayerNorm(config.hidden_size, dtype=params_dtype, device=device)
                self.output_layer = ParallelLMHead(config.hidden_size, config.vocab_size, tp_group=tp_group,
                                                   init_method=init, sequence_parallel=self.sequence_parallel,
                                                   params_dtype=params_dtype, device=device)
            for param in self.final_layernorm.parameters():  # sees only local tokens under SP: partial grads
                param.sequence_parallel = self.sequence_parallel
            if config.share_embeddings_and_output_weights and is_first:  # one stage: one Parameter
                self.output_layer.output_layer.weight = self.embedding.word_embeddings.weight

    def activation_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        """Shape of the hidden state sent between stages (megatron/core/pipeline_parallel/schedules.py::
        get_tensor_shapes: the sequence divided by TP under sequence parallelism)."""
        s = self.config.seq_length // (self.tp_group.size() if self.sequence_parallel else 1)
        return (s, micro_batch_size, self.config.hidden_size)

    def forward(self, hidden: torch.Tensor | None, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mirrors `megatron-lm:megatron/core/models/gpt/gpt_model.py::GPTModel.forward`."""
        if self.is_first:
            if tokens.shape[1] != self.config.seq_length:
                raise ParallelConfigError(f"tokens have sequence length {tokens.shape[1]}, the model "
                                          f"{self.config.seq_length}")
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.embedding.word_embeddings(tokens) + self.embedding.position_embeddings(positions)
            hidden = x.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
            if self.sequence_parallel:
                hidden = scatter_to_sequence_parallel_region(hidden, self.tp_group)
        for layer in self.layers:
            hidden = layer(hidden)
        if not self.is_last:
            return hidden
        return self.output_layer(self.final_layernorm(hidden), labels).mean()


def build_stage(config: GPTConfig, layout: ParallelLayout, *, sequence_parallel: bool = False, seed: int = 1234,
                device=None, params_dtype: torch.dtype = torch.float32, **block_kwargs) -> GPTStage:
    """This rank's stage: its PP rank's share of split_layers, tensor-parallel over its TP group."""
    first, last = split_layers(config.num_layers, layout.pp_size)[layout.pp_rank]
    return GPTStage(config, layout.tp_group, first_layer=first, last_layer=last, is_first=layout.pp_rank == 0,
                    is_last=layout.pp_rank == layout.pp_size - 1, sequence_parallel=sequence_parallel, seed=seed,
                    device=device, params_dtype=params_dtype, **block_kwargs)


def split_virtual_stages(num_layers: int, pp_size: int, virtual_stages: int) -> list[list[tuple[int, int]]]:
    """[first, last) layers of each chunk of each stage for interleaved 1F1B: the layers cut into p * v equal
    virtual stages, chunk c of PP rank r being virtual stage c * p + r (megatron/core/transformer/
    transformer_layer.py::get_transformer_layer_offset), so a micro-batch visits every rank v times. Megatron
    refuses layer counts that p * v does not divide (megatron/core/transformer/transformer_config.py::
    TransformerConfig.__post_init__: layers per stage divisible by the virtual size)."""
    p, v = pp_size, virtual_stages
    if p < 1 or v < 1:
        raise ParallelConfigError(f"pipeline and virtual stages must be at least 1, got pp {p} and {v}")
    if num_layers % (p * v):
        raise ParallelConfigError(f"{num_layers} transformer layers do not split into pp {p} x {v} virtual stages "
                                  f"of equal size; use a multiple of {p * v} layers")
    per_chunk = num_layers // (p * v)
    return [[((c * p + r) * per_chunk, (c * p + r + 1) * per_chunk) for c in range(v)] for r in range(p)]


def build_chunks(config: GPTConfig, layout: ParallelLayout, virtual_stages: int, *, sequence_parallel: bool = False,
                 seed: int = 1234, device=None, params_dtype: torch.dtype = torch.float32,
                 **block_kwargs) -> list[GPTStage]:
    """This rank's v model chunks for interleaved 1F1B (split_virtual_stages), tensor-parallel over its TP group."""
    p, r, v = layout.pp_size, layout.pp_rank, virtual_stages
    bounds = split_virtual_stages(config.num_layers, p, v)[r]
    return [GPTStage(config, layout.tp_group, first_layer=first, last_layer=last, is_first=first == 0,
                     is_last=last == config.num_layers, sequence_parallel=sequence_parallel, seed=seed,
                     device=device, params_dtype=params_dtype, **block_kwargs) for first, last in bounds]

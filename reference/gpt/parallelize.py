"""`parallelize_gpt(model, tp_group)`: a plain GPT (or stage) split over TP by swapping its layers, and this
rank's pipeline stage or interleaved chunks built that way.

The word embedding becomes a VocabParallelEmbedding and the head + loss an LMHead split over TP (vocabulary-parallel
cross-entropy), each holding this rank's rows of the same weights; every block goes through parallelize_block.
Under sequence parallelism the embeddings are scattered along the sequence, and a "llama" sequence the TP size
does not divide is padded at the end, its pad labels dropped before the mean (causal attention keeps real
tokens blind to the pad); "gpt2" has one position row per token and refuses instead.

Mirrors torchtitan's `parallelize_llama`, over the layers
`megatron-lm:megatron/core/models/gpt/gpt_model.py::GPTModel.__init__` builds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.gpt.model import GPT, GPTConfig, split_layers, split_virtual_stages
from reference.parallel_state import ParallelConfigError, ParallelLayout, divide
from reference.pipeline.interleaved import check_interleaving
from reference.pipeline.zero_bubble import V_SCHEDULES, check_zero_bubble, v_layers
from reference.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from reference.tensor_parallel.parallelize import parallelize_block, split_query_groups
from reference.tensor_parallel.random import TensorParallelRNG
from reference.tensor_parallel.vocab_parallel import LMHead, VocabParallelEmbedding


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
    """The sequence length the stage runs: under SP, rounded up to a multiple of tp."""
    if not (sequence_parallel and tp > 1):
        return config.seq_length
    return -(-config.seq_length // tp) * tp


def _copy_of(weight: torch.Tensor):
    """An init method filling the master with `weight` (the swapped layer keeps this rank's rows of it)."""
    full = weight.detach()
    return lambda master: master.copy_(full)


def _pad_ids(seq_length: int, index: int):
    """A forward pre-hook padding argument `index` ([b, s] ids) with id 0 up to `seq_length`."""

    def hook(module, args):
        ids = args[index]
        return (*args[:index], F.pad(ids, (0, seq_length - ids.shape[1])), *args[index + 1 :])

    return hook


def parallelize_gpt(
    model: GPT, tp_group: dist.ProcessGroup, *, sequence_parallel: bool = False, seed: int = 1234, **block_options
) -> GPT:
    """Split `model` over `tp_group` in place. The blocks share one TP dropout stream seeded `seed`;
    `block_options` go to reference.tensor_parallel.parallelize.parallelize_block (recompute, ...).

    Mirrors `megatron-lm:megatron/core/models/gpt/gpt_model.py::GPTModel.__init__`.
    """
    config, tp = model.config, tp_group.size()
    sp = sequence_parallel and tp > 1
    check_tensor_parallel(config, tp, sp)
    model.seq_length, model.seq_shards = padded_seq_length(config, tp, sp), tp if sp else 1
    device = next(model.parameters()).device
    rng = TensorParallelRNG(seed, tp_group, device)
    for block in model.layers:
        parallelize_block(block, tp_group, rng=rng, sequence_parallel=sp, **block_options)
    if model.is_first:
        word = model.embedding.word_embeddings.weight
        model.embedding.word_embeddings = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            tp_group=tp_group,
            init_method=_copy_of(word),
            params_dtype=word.dtype,
            device=word.device,
        )
        if model.seq_length != config.seq_length:
            model.embedding.register_forward_pre_hook(_pad_ids(model.seq_length, 0))
        if sp:
            model.embedding.register_forward_hook(lambda m, a, out: scatter_to_sequence_parallel_region(out, tp_group))
    if model.is_last:
        head = model.output_layer.weight
        model.output_layer = LMHead(
            config.hidden_size,
            config.vocab_size,
            tp_group=tp_group,
            init_method=_copy_of(head),
            sequence_parallel=sp,
            params_dtype=head.dtype,
            device=head.device,
        )
        if model.seq_length != config.seq_length:  # the pad positions' losses leave the mean
            model.output_layer.register_forward_pre_hook(_pad_ids(model.seq_length, 1))
            model.output_layer.register_forward_hook(lambda m, a, loss: loss[:, : config.seq_length])
        for param in model.final_layernorm.parameters():  # sees only local tokens under SP: partial grads
            param.sequence_parallel = sp
        if config.share_embeddings_and_output_weights and model.is_first:  # one stage: one Parameter
            model.output_layer.weight = model.embedding.word_embeddings.weight
    return model


def stage_layers(
    config: GPTConfig, layout: ParallelLayout, virtual_stages: int = 1, schedule: str = "1f1b"
) -> list[tuple[int, int]]:
    """[first, last) layers of each of this rank's model chunks: its PP rank's share of split_layers, or, with
    v > 1 virtual stages, its v interleaved chunks (split_virtual_stages), or, for a schedule on a V (zbv,
    dualpipev), its two stages of the V (reference.pipeline.zero_bubble.v_layers)."""
    if schedule in V_SCHEDULES:
        check_zero_bubble(schedule, layout.pp_size, num_layers=config.num_layers)
        return v_layers(config.num_layers, layout.pp_size, layout.pp_rank)
    if virtual_stages > 1:
        return split_virtual_stages(config.num_layers, layout.pp_size, virtual_stages)[layout.pp_rank]
    return [split_layers(config.num_layers, layout.pp_size)[layout.pp_rank]]


def build_chunks(
    config: GPTConfig,
    layout: ParallelLayout,
    virtual_stages: int = 1,
    *,
    schedule: str = "1f1b",
    seed=1234,
    device=None,
    params_dtype=torch.float32,
    **options,
) -> list[GPT]:
    """A GPT of each of this rank's chunks, split over its TP group (stage_layers: v > 1 for interleaved 1F1B,
    or the two stages of the V of `schedule` zbv or dualpipev)."""
    return [
        parallelize_gpt(
            GPT(config, seed, device, layers=layers, params_dtype=params_dtype), layout.tp_group, seed=seed, **options
        )
        for layers in stage_layers(config, layout, virtual_stages, schedule)
    ]


def build_stage(config: GPTConfig, layout: ParallelLayout, **options) -> GPT:
    """This rank's stage: its PP rank's share of split_layers, split over its TP group. `options`: seed,
    device, params_dtype, and parallelize_gpt's (sequence_parallel, block arguments)."""
    (stage,) = build_chunks(config, layout, 1, **options)
    return stage


def check_virtual_pipeline(num_layers: int, pp_size: int, virtual_stages: int, micro_batches: int) -> None:
    """megatron-core's refusals of an interleaved pipeline, each one line: layers that do not cut into pp x v
    equal chunks (split_virtual_stages), fewer than 2 stages or micro-batches not a multiple of pp
    (reference.pipeline.interleaved.check_interleaving)."""
    split_virtual_stages(num_layers, pp_size, virtual_stages)
    check_interleaving(pp_size, virtual_stages, micro_batches)

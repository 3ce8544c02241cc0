"""The Tensor Parallelism Knowledge Compilation's DTensor recipe, applied to Hugging Face's own `Qwen2ForCausalLM`.

Not our implementation: PyTorch DTensor's parallel styles on real HF code, written once here for the demo
(`python -m reference.hf_tp`), the oracle tests (tests/evidence/test_qwen2_dtensor.py) and the decoder
benchmark. Imports transformers (a test extra). Plans:

- `document_plan`: q/k/v and gate/up `ColwiseParallel`, o and down `RowwiseParallel`; with `sequence_parallel`
  the norms are `SequenceParallel`, attention's keyword input and the MLP's positional input go Shard(1) ->
  Replicate through `PrepareModuleInput`, and the row layers output Shard(1). The embedding is row-wise, the
  head column-wise with `use_local_output=False` (logits stay a vocab-sharded DTensor for `loss_parallel`).
- `hf_plan`: the plan HF ships on the class (`Qwen2ForCausalLM.tp_plan`), through transformers' own
  `apply_tensor_parallelism`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from transformers import Qwen2Config, Qwen2ForCausalLM

IGNORE_INDEX = -100


def tiny_config(**overrides) -> Qwen2Config:
    """A Qwen2 small enough for CPU: 4 query heads sharing 2 KV heads (GQA), untied head, fp32, SDPA attention."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen2Config(**(fields | overrides))


def build(config: Qwen2Config, seed: int = 0) -> Qwen2ForCausalLM:
    """Random weights from `seed`: every rank builds the same full model, then a plan keeps its shards."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def block_plan(sequence_parallel: bool) -> dict:
    """The document's plan for one `Qwen2DecoderLayer` (section 1 without, section 2 with sequence parallelism)."""
    if not sequence_parallel:
        return {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
    return {
        "input_layernorm": SequenceParallel(),
        "post_attention_layernorm": SequenceParallel(),
        # the decoder layer calls self_attn(hidden_states=...): a keyword layout, not a positional one
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def top_plan(sequence_parallel: bool) -> dict:
    """Embedding row-wise (vocab-sharded), head column-wise keeping its DTensor output for `loss_parallel`."""
    plan = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sequence_parallel else Replicate()
        ),
        "lm_head": ColwiseParallel(use_local_output=False),
    }
    if sequence_parallel:
        plan["model.norm"] = SequenceParallel()
    return plan


def document_plan(model: Qwen2ForCausalLM, tp_mesh: DeviceMesh, sequence_parallel: bool) -> Qwen2ForCausalLM:
    """Section 3 of the document: every decoder layer, then the embedding, final norm and head."""
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, block_plan(sequence_parallel))
    return parallelize_module(model, tp_mesh, top_plan(sequence_parallel))


def hf_plan(model: Qwen2ForCausalLM, tp_mesh: DeviceMesh) -> Qwen2ForCausalLM:
    """HF's own plan (`model.tp_plan`: embedding_rowwise, colwise, rowwise, colwise_gather_output) through
    transformers' tensor-parallel API, with its `*` expanded to this model's layers as `from_pretrained` does."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    return apply_tensor_parallelism(model, tp_mesh, model._expand_parallel_plan(model.tp_plan))


def fsdp2_2d(
    model: Qwen2ForCausalLM, mesh: DeviceMesh, sequence_parallel: bool, param_dtype: torch.dtype = torch.bfloat16
) -> Qwen2ForCausalLM:
    """The document's working configuration: the TP plan on mesh["tp"], each decoder layer checkpointed
    (full recompute) and `fully_shard`ed on mesh["dp"] with bf16 compute and fp32 gradient reduction, then
    the root."""
    document_plan(model, mesh["tp"], sequence_parallel)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for index, layer in enumerate(model.model.layers):
        layer = checkpoint_wrapper(layer)
        model.model.layers[index] = layer
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    return fully_shard(model, mesh=mesh["dp"], mp_policy=policy)


def shift_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets for every position (the last one ignored), as HF's causal-LM loss shifts them."""
    return F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)


def pad_to_multiple(x: torch.Tensor, multiple: int, value: int) -> torch.Tensor:
    """The document's fix for sequence parallelism: pad the sequence (last) dimension to a multiple of TP."""
    return F.pad(x, (0, (-x.size(-1)) % multiple), value=value)


def loss_and_backward(
    model: Qwen2ForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross-entropy and its backward. Vocab-sharded DTensor logits go through `loss_parallel()`
    (cross-entropy and backward inside it, as it requires); plain logits through the same `F.cross_entropy`.
    Returns the loss as a plain tensor (a DTensor loss is made local before anyone reduces it)."""
    logits = model(input_ids=input_ids, position_ids=position_ids).logits
    flat_logits, flat_labels = logits.flatten(0, 1), labels.flatten()
    if isinstance(logits, DTensor):
        with loss_parallel():
            loss = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)
            loss.backward()
        return loss.full_tensor().detach()
    loss = F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach()

"""Hugging Face Qwen2 <-> the "llama" style of reference.gpt.model: the config and the parameter-name mapping.

The oracle of the llama block is transformers' own `Qwen2ForCausalLM`. `qwen2_config(config)` builds the
matching `Qwen2Config` (transformers is imported only there: a test and benchmark dependency);
`master_state_from_hf(config, hf_state)` turns its state dict (weights, or gradients: the mapping is a pure
rearrangement) into the unsharded reference's names and layouts, q/k/v fused per group and [gate; up] stacked;
`stage_state_from_master(stage, master)` cuts this TP rank's slices, so one HF model loads into any TP x PP
split. docs/reference-guide.md has the name table.
"""

from __future__ import annotations

import torch

from reference.gpt.model import GPTConfig
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_of

_SAME = {
    "input_layernorm.weight": "ln1.weight",
    "post_attention_layernorm.weight": "ln2.weight",
    "self_attn.o_proj.weight": "attention.proj.weight",
    "mlp.down_proj.weight": "mlp.fc2.weight",
}


def qwen2_config(config: GPTConfig, **overrides):
    """The transformers Qwen2Config of the same model (eager attention unless overridden)."""
    from transformers import Qwen2Config

    if config.style != "llama":
        raise ValueError(f"only the llama style maps onto Qwen2, got style {config.style!r}")
    return Qwen2Config(
        **{
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.ffn_hidden_size or 4 * config.hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.kv_heads,
            "max_position_embeddings": max(config.seq_length, 64),
            "rms_norm_eps": config.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
            "tie_word_embeddings": False,
            "attention_dropout": 0.0,
            "attn_implementation": "eager",
            **overrides,
        }
    )


def _grouped_qkv(config: GPTConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Separate q [heads d, ...], k and v [kv_heads d, ...] -> fused [groups, (q heads of the group, k, v), d, ...]."""
    g, d = config.kv_heads, config.head_dim
    q = q.reshape(g, -1, d, *q.shape[1:])
    return torch.cat([q, k.reshape(g, 1, d, *k.shape[1:]), v.reshape(g, 1, d, *v.shape[1:])], dim=1).flatten(0, 2)


def master_state_from_hf(config: GPTConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen2ForCausalLM state dict (or its gradients, by the same names) -> the whole GPT's (table above)."""
    hf = {name.removeprefix("model."): t for name, t in hf_state.items()}
    master = {
        "embedding.word_embeddings.weight": hf["embed_tokens.weight"],
        "final_layernorm.weight": hf["norm.weight"],
        "output_layer.weight": hf["lm_head.weight"],
    }
    for i in range(config.num_layers):
        theirs, ours = f"layers.{i}.", f"layers.{i}."
        for their_name, our_name in _SAME.items():
            master[ours + our_name] = hf[theirs + their_name]
        for kind in ("weight", "bias"):
            q, k, v = (hf[f"{theirs}self_attn.{x}_proj.{kind}"] for x in "qkv")
            master[f"{ours}attention.qkv.{kind}"] = _grouped_qkv(config, q, k, v)
        master[ours + "mlp.fc1.weight"] = torch.cat(
            [hf[theirs + "mlp.gate_proj.weight"], hf[theirs + "mlp.up_proj.weight"]]
        )
    return master


def stage_state_from_master(stage: torch.nn.Module, master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This TP rank's tensors for every parameter of a parallelized GPT stage, by the stage's own names."""
    out = {}
    for module_name, module in stage.named_modules():
        for param_name, _param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}"
            full = master[master_name(stage, name)]
            if getattr(module, "padded_vocab_size", None) and module.tp_group is not None:  # embedding or head
                full = shard_of(_pad_rows(full, module.padded_vocab_size), 0, module.tp_group)
            elif isinstance(module, ColumnParallelLinear):
                full = shard_of(full, 0, module.tp_group, module.stride)
            elif isinstance(module, RowParallelLinear) and param_name == "weight":
                full = shard_of(full, 1, module.tp_group)
            out[name] = full
    return out


def load_hf_into_stage(stage: torch.nn.Module, hf_state: dict[str, torch.Tensor]) -> None:
    """Copy a Qwen2ForCausalLM state dict into a parallelized GPT stage (any TP rank, any stage of the split)."""
    state = stage_state_from_master(stage, master_state_from_hf(stage.config, hf_state))
    with torch.no_grad():
        for name, param in stage.named_parameters():
            param.copy_(state[name])


def master_name(stage: torch.nn.Module, name: str) -> str:
    """A stage's (or chunk's) parameter name -> the unsharded model's: the global layer index. The tests compare
    stages with the whole GPT by it too."""
    if name.startswith("layers."):
        _, local, rest = name.split(".", 2)
        return f"layers.{stage.first_layer + int(local)}.{rest}"
    return name


def _pad_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary padded with zero rows (vocab_parallel's pad rows are zero)."""
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])

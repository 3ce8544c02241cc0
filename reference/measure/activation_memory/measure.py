"""Build one reference block (GPT-2 or Llama) in a configuration of Korthikanti et al.'s Table 2 and count the
bytes its forward keeps for backward: the code the tests and benchmarks/bench_activation_memory.py share."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from reference.gpt.model import GPTConfig
from reference.gpt.parallelize import check_tensor_parallel
from reference.measure.activation_memory import gpt2_block, llama_block
from reference.measure.activation_memory.counting import SavedTensorCounter
from reference.measure.activation_memory.llama_block import LlamaSetting
from reference.measure.activation_memory.paper import CONFIGURATIONS, FORMULAS, Setting, table2_bytes
from reference.measure.activation_memory.term_table import Row, whole
from reference.parallel_state import divide
from reference.tensor_parallel.parallelize import parallelize_block
from reference.tensor_parallel.random import TensorParallelRNG

DROPOUT = 0.1  # the paper counts dropout masks: dropout on everywhere (the GPT-2 block; Llama has none)
MODELS = {  # model: (its closed forms by configuration, its term table)
    "gpt2": (FORMULAS, gpt2_block.rows),
    "llama": (llama_block.FORMULAS, llama_block.rows),
}


@dataclasses.dataclass(frozen=True)
class Count:
    configuration: str
    formula: str  # the model's closed form: Table 2 for GPT-2, llama_block.FORMULAS for Llama
    setting: Setting
    table2_bytes: int  # Table 2 for a GPT-2 layer of the setting's s, b, h, a, t (the rows' paper column)
    counted_bytes: int
    rows: list[Row]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)  # the setting and the rows as dicts too, in field order


def setting(model: str, configuration: str, shape: dict, t: int) -> Setting:
    """shape: s, b, h, a, and for "llama" k (key/value heads) and f (SwiGLU size)."""
    return (LlamaSetting if model == "llama" else Setting).of(configuration, t=t, **shape)


def model_config(x: Setting) -> GPTConfig:
    """The GPTConfig of the block the setting describes; its checks and check_tensor_parallel refuse, in one
    line, sizes a model could not be built or split with."""
    if isinstance(x, LlamaSetting):
        config = GPTConfig(
            hidden_size=x.h,
            num_attention_heads=x.a,
            seq_length=x.s,
            ffn_hidden_size=x.f,
            style="llama",
            num_kv_heads=x.k,
        )
    else:
        config = GPTConfig(
            hidden_size=x.h, num_attention_heads=x.a, seq_length=x.s, hidden_dropout=DROPOUT, attention_dropout=DROPOUT
        )
    check_tensor_parallel(config, x.t, x.sequence_parallel)
    if x.sequence_parallel:  # the model pads a Llama sequence instead; one block's count takes whole shares
        divide(x.s, x.t, "the sequence length", by="the tensor-parallel size (sequence parallel)")
    return config


def build_block(x: Setting, tp_group: dist.ProcessGroup, device, dtype=torch.bfloat16) -> tuple[torch.nn.Module, tuple]:
    """The block, and its forward's arguments as a model passes them: this rank's [s, b, h] input ([s / t, b,
    h] under sequence parallelism), needing a gradient as a layer's input does (the checkpoints save only
    inputs that take part in autograd), and for the Llama block the fp32 rotary (cos, sin) of the sequence."""
    config = model_config(x)
    block = parallelize_block(
        config.block(dtype, device),
        tp_group,
        sequence_parallel=x.sequence_parallel,
        rng=TensorParallelRNG(0, tp_group, device),  # as GPTModel passes one to each block
        recompute=x.recompute,
    )
    layer_input = torch.randn(x.s // x.split("sp"), x.b, x.h, device=device, dtype=dtype, requires_grad=True)
    return block, (layer_input, *config.rotary(x.s, device))


def count(
    model: str, configuration: str, shape: dict, tp_group: dist.ProcessGroup, device, explain: bool = True
) -> Count:
    """One forward of one block; `tp_group` sets t for the tensor-parallel configurations (a size-1 group
    is used for "no parallelism"). `explain`: name every saved tensor by its term (the term tables explain the
    CPU kernels; on CUDA the fused attention and dropout save other tensors, so only the total is counted)."""
    x = setting(model, configuration, shape, tp_group.size())
    if x.t != tp_group.size():
        raise ValueError(f"{configuration!r} runs without tensor parallelism: pass a group of size 1")
    formulas, rows = MODELS[model]
    block, inputs = build_block(x, tp_group, device)
    with SavedTensorCounter(block) as counter:
        block(*inputs)
    return Count(
        configuration,
        formulas[configuration],
        x,
        whole(table2_bytes(x)),
        counter.total_bytes,
        rows(counter.saved, x) if explain else [],
    )


def count_all(
    model: str, shape: dict, tp_groups: dict[int, dist.ProcessGroup], device, explain: bool = True
) -> list[Count]:
    """Every configuration of Table 2; tp_groups[1] for the unparallel one, tp_groups[t] for the others."""
    t = max(tp_groups)
    return [
        count(model, name, shape, tp_groups[t if tensor_parallel else 1], device, explain)
        for name, (tensor_parallel, _, _) in CONFIGURATIONS.items()
    ]

"""Build one reference GPT-2 block in a configuration of Korthikanti et al.'s Table 2 and count the bytes its
forward keeps for backward: the code the tests and benchmarks/bench_activation_memory.py share."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from reference.activation_memory import gpt2_block
from reference.activation_memory.counting import SavedTensorCounter
from reference.activation_memory.paper import CONFIGURATIONS, FORMULAS, Setting, table2_bytes
from reference.tensor_parallel.transformer import ParallelTransformerBlock

DROPOUT = 0.1  # the paper counts dropout masks: dropout on everywhere


@dataclasses.dataclass(frozen=True)
class Count:
    configuration: str
    setting: Setting
    table2_bytes: int
    counted_bytes: int
    rows: list[gpt2_block.Row]

    def to_dict(self) -> dict:
        return {
            "configuration": self.configuration,
            "formula": FORMULAS[self.configuration],
            "setting": dataclasses.asdict(self.setting),
            "table2_bytes": self.table2_bytes,
            "counted_bytes": self.counted_bytes,
            "rows": [dataclasses.asdict(r) for r in self.rows],
        }


def build_block(x: Setting, tp_group: dist.ProcessGroup, device, dtype=torch.bfloat16) -> ParallelTransformerBlock:
    return ParallelTransformerBlock(
        x.h,
        x.a,
        tp_group=tp_group,
        sequence_parallel=x.sequence_parallel,
        hidden_dropout=DROPOUT,
        attention_dropout=DROPOUT,
        params_dtype=dtype,
        device=device,
        recompute=x.recompute,
    )


def layer_input(x: Setting, device, dtype=torch.bfloat16) -> torch.Tensor:
    """This rank's [s, b, h] input ([s / t, b, h] under sequence parallelism), needing a gradient as a layer's
    input does (the checkpoints save only inputs that take part in autograd)."""
    rows = x.s // x.split("sp")
    return torch.randn(rows, x.b, x.h, device=device, dtype=dtype, requires_grad=True)


def count(
    configuration: str, s: int, b: int, h: int, a: int, tp_group: dist.ProcessGroup, device, explain: bool = True
) -> Count:
    """One forward of one block; `tp_group` sets t for the tensor-parallel configurations (a size-1 group
    is used for "no parallelism"). `explain`: name every saved tensor by its term (gpt2_block explains the
    CPU kernels; on CUDA the fused attention and dropout save other tensors, so only the total is counted)."""
    x = Setting.of(configuration, s, b, h, a, tp_group.size())
    if x.t != tp_group.size():
        raise ValueError(f"{configuration!r} runs without tensor parallelism: pass a group of size 1")
    block = build_block(x, tp_group, device)
    inputs = layer_input(x, device)
    with SavedTensorCounter(block) as counter:
        block(inputs)
    return Count(
        configuration,
        x,
        gpt2_block.whole(table2_bytes(x)),
        counter.total_bytes,
        gpt2_block.rows(counter.saved, x) if explain else [],
    )


def count_all(
    s: int, b: int, h: int, a: int, tp_groups: dict[int, dist.ProcessGroup], device, explain: bool = True
) -> list[Count]:
    """Every configuration of Table 2; tp_groups[1] for the unparallel one, tp_groups[t] for the others."""
    t = max(tp_groups)
    return [
        count(name, s, b, h, a, tp_groups[t if tensor_parallel else 1], device, explain)
        for name, (tensor_parallel, _, _) in CONFIGURATIONS.items()
    ]

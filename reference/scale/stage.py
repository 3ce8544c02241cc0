"""One pipeline stage of a tensor-parallel GPT: embedding on the first stage, its share of the blocks, final
LayerNorm, LM head and loss on the last (megatron/core/models/gpt/gpt_model.py::GPTModel with pre_process /
post_process). Built from reference.tensor_parallel, so the collectives traced at scale are the reference's.

Built under `torch.device("meta")`, a stage of a 70B model holds shapes only: no weight is allocated, and
every matmul, attention and collective runs on shapes (the fake process group accepts meta tensors).
Stand-in until reference/gpt lands; same layers, same order.
"""
from __future__ import annotations

import torch

from reference.parallel_state import ParallelLayout
from reference.scale.shapes import ScaleSetup
from reference.tensor_parallel.random import TensorParallelRNG
from reference.tensor_parallel.transformer import ParallelTransformerBlock
from reference.tensor_parallel.unsharded import init_method_normal
from reference.tensor_parallel.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


class Stage(torch.nn.Module):
    """forward(x, labels): x is token ids [b, s] on the first stage, else the previous stage's [s(/t), b, h];
    returns the next stage's input, or on the last stage the per-token loss [b, s]."""

    def __init__(self, setup: ScaleSetup, layout: ParallelLayout, device: torch.device | str | None = None):
        super().__init__()
        model, group = setup.model, layout.tp_group
        self.first, self.last = layout.pp_rank == 0, layout.pp_rank == layout.pp_size - 1
        self.sp = setup.sp and setup.tp > 1
        kw = dict(tp_group=group, sequence_parallel=setup.sp, params_dtype=getattr(torch, model.dtype),
                  device=device)
        if self.first:
            self.embedding = VocabParallelEmbedding(model.vocab_size, model.hidden_size,
                                                    init_method=init_method_normal(), **kw)
        rng = TensorParallelRNG(0, group)  # no dropout here: a CPU stream, never drawn from
        self.layers = torch.nn.ModuleList(
            ParallelTransformerBlock(model.hidden_size, model.num_attention_heads,
                                     ffn_hidden_size=model.ffn_hidden_size, rng=rng, **kw)
            for _ in range(setup.layers_per_stage))
        if self.last:
            self.final_layernorm = torch.nn.LayerNorm(model.hidden_size, dtype=kw["params_dtype"], device=device)
            for param in self.final_layernorm.parameters():
                param.sequence_parallel = self.sp
            self.head = ParallelLMHead(model.hidden_size, model.vocab_size, init_method=init_method_normal(), **kw)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            x = self.embedding(x)
            if not self.sp:
                x = x.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        for layer in self.layers:
            x = layer(x)
        if self.last:
            return self.head(self.final_layernorm(x), labels)
        return x

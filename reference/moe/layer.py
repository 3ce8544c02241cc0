"""The mixture-of-experts layer, written once: route, permute, dispatch, experts, return, combine.

As written it is the unsharded layer (EP 1, TP 1): the dispatcher has no groups and every expert is here.
parallelize_moe splits the experts over an expert-parallel group (and each expert over TP) and gives the
dispatcher its groups; the forward below does not change. It stands where a block's MLP stands: [s, b, h] in,
[s, b, h] out. Gate and experts are drawn from the global RNG in that order (gate, then each expert's fc1 and
fc2), so equal seeds give equal layers.

Mirrors `megatron-lm:megatron/core/transformer/moe/moe_layer.py::MoELayer.forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from reference.moe.combine import combine
from reference.moe.dispatcher import AllToAllDispatcher
from reference.moe.experts import SequentialMLP
from reference.moe.permute import permute
from reference.moe.router import TopKRouter
from reference.tensor_parallel.transformer import MLP, init_method_normal


class MoELayer(torch.nn.Module):
    """E experts (MLPs of hidden -> ffn -> hidden, no biases; `gated`: SwiGLU), top-`topk` routing.

    Router options: aux_loss_coeff (0: no load-balancing loss), capacity_factor (None: dropless),
    drop_policy ("probs" or "position").
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        topk: int = 2,
        *,
        init_method: Callable | None = None,
        gated: bool = False,
        params_dtype=torch.float32,
        device=None,
        **router_options,
    ):
        super().__init__()
        init, kw = init_method or init_method_normal(), dict(dtype=params_dtype, device=device)
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.router = TopKRouter(
            hidden_size, num_experts, topk, init, params_dtype=params_dtype, device=device, **router_options
        )
        self.experts = SequentialMLP(
            [MLP(hidden_size, ffn_hidden_size, init, gated=gated, bias=False, **kw) for _ in range(num_experts)]
        )
        self.dispatcher = AllToAllDispatcher(num_experts)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Mirrors `megatron-lm:megatron/core/transformer/moe/moe_layer.py::MoELayer.forward`."""
        tokens = hidden_states.reshape(-1, self.hidden_size)
        probs, routing_map = self.router(tokens)
        permuted, sorted_indices = permute(tokens, routing_map)
        rows, tokens_per_expert = self.dispatcher.dispatch(permuted, routing_map.sum(dim=0))
        rows = self.dispatcher.combine(self.experts(rows, tokens_per_expert))
        return combine(rows, probs, routing_map, sorted_indices).view_as(hidden_states)

"""The top-k router: a linear gate gives each token a logit per expert; the token goes to its k largest.

At the pin megatron-core's defaults (`moe_router_score_function="softmax"`, `moe_router_pre_softmax=False`)
take the top k of the logits and then a softmax over those k, so a token's k weights sum to 1. The
load-balancing loss (Switch Transformer) is attached to the probabilities: it adds nothing to the forward
output and its gradient, with weight 1, joins the router's in backward.

Mirrors `megatron-lm:megatron/core/transformer/moe/router.py::TopKRouter.routing`,
`megatron-lm:megatron/core/transformer/moe/moe_utils.py::topk_routing_with_score_function` and
`megatron-lm:megatron/core/transformer/moe/moe_utils.py::switch_load_balancing_loss_func`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from reference.moe.capacity import drop_beyond_capacity
from reference.tensor_parallel import collectives as C


def topk_softmax(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (probs [T, E], zero off the k chosen; routing_map [T, E] bool): the top k of the
    logits, then a softmax over those k (megatron's default, pre-softmax off).

    Mirrors `megatron-lm:megatron/core/transformer/moe/moe_utils.py::topk_routing_with_score_function`.
    """
    top_logits, top_indices = torch.topk(logits, k=topk, dim=1)
    top_probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
    probs = torch.zeros_like(logits).scatter(1, top_indices, top_probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int).scatter(1, top_indices, 1).bool()
    return probs, routing_map


def load_balancing_loss(
    logits: torch.Tensor, topk: int, coeff: float, count_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """coeff * E * sum_i f_i P_i: f_i the fraction of routed (token, expert) pairs that chose expert i, P_i the
    mean softmax probability of expert i, over the tokens of `count_group` (the TP group under sequence
    parallelism: its ranks hold slices of one sequence; None: this rank's tokens). Each rank's loss holds only
    its own tokens' probabilities, so the group's gradients add up to the whole sequence's.

    Mirrors `megatron-lm:megatron/core/transformer/moe/moe_utils.py::switch_load_balancing_loss_func` and
    `megatron-lm:megatron/core/transformer/moe/moe_utils.py::get_tokens_per_expert_and_token_count`.
    """
    num_tokens, num_experts = logits.shape
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)  # over all E, unlike the routing probs
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    tokens_per_expert = torch.zeros_like(scores).scatter(1, top_indices, 1.0).sum(dim=0)
    ranks = 1
    if count_group is not None and count_group.size() > 1:
        tokens_per_expert, ranks = C.all_reduce(tokens_per_expert, count_group), count_group.size()
    total = num_tokens * ranks
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (num_experts * coeff / (topk * total * total))


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: return `probs` unchanged; backward: pass its gradient through and give `aux_loss` gradient 1,
    so the auxiliary loss is trained without being added to the model's loss.

    Mirrors `megatron-lm:megatron/core/transformer/moe/moe_utils.py::MoEAuxLossAutoScaler`.
    """

    @staticmethod
    def forward(ctx, probs, aux_loss):
        ctx.save_for_backward(aux_loss)
        return probs

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss)


class TopKRouter(torch.nn.Module):
    """Gate weight [E, h] (no bias), top-k routing, optional capacity, optional load-balancing loss.

    capacity_factor None: dropless (megatron's default); else each expert takes at most
    ceil(T k / E * capacity_factor) of this rank's T tokens, keeping the most probable (`drop_policy="probs"`,
    megatron's default) or the earliest (`"position"`). `count_group`: where the load-balancing loss counts
    tokens (set by parallelize_moe to the TP group).

    Mirrors `megatron-lm:megatron/core/transformer/moe/router.py::TopKRouter.forward`.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        topk: int,
        init_method: Callable,
        *,
        aux_loss_coeff: float = 0.0,
        capacity_factor: float | None = None,
        drop_policy: str = "probs",
        params_dtype=torch.float32,
        device=None,
    ):
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be between 1 and the number of experts ({num_experts}), got {topk}")
        self.num_experts, self.topk = num_experts, topk
        self.aux_loss_coeff, self.capacity_factor, self.drop_policy = aux_loss_coeff, capacity_factor, drop_policy
        self.count_group: dist.ProcessGroup | None = None
        master = torch.empty(num_experts, hidden_size, dtype=torch.float32)
        init_method(master)  # drawn first, as megatron's Router.reset_parameters draws it
        self.weight = torch.nn.Parameter(master.to(dtype=params_dtype, device=device))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, h] -> (probs [T, E], routing_map [T, E]).

        Mirrors `megatron-lm:megatron/core/transformer/moe/router.py::TopKRouter.routing`.
        """
        logits = torch.nn.functional.linear(tokens, self.weight)
        probs, routing_map = topk_softmax(logits, self.topk)
        if self.capacity_factor is not None:
            probs, routing_map = drop_beyond_capacity(
                probs, routing_map, self.topk, self.capacity_factor, self.drop_policy
            )
        if self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            aux = load_balancing_loss(logits, self.topk, self.aux_loss_coeff, self.count_group)
            probs = _AttachAuxLoss.apply(probs, aux)
        return probs, routing_map

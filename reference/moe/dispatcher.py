"""The all-to-all token dispatcher: each rank sends every routed token to the rank holding its expert, and back.

Experts are laid out rank by rank (EP rank r holds experts r L .. r L + L - 1), so a permuted batch is already
grouped by destination. Counts go first: an all-to-all of the tokens-per-expert tells each rank how many rows
it will receive from each peer, the split sizes of the second all-to-all, which moves the tokens. Under expert
tensor parallelism the received rows are then gathered over the TP group. The rows arrive grouped by sender;
they are sorted by local expert for the experts, and `combine` undoes every step in reverse order.

Mirrors `megatron-lm:megatron/core/transformer/moe/token_dispatcher.py::MoEAlltoAllTokenDispatcher.preprocess`,
`megatron-lm:megatron/core/transformer/moe/token_dispatcher.py::MoEAlltoAllTokenDispatcher.token_dispatch` and
`megatron-lm:megatron/core/transformer/moe/token_dispatcher.py::MoEAlltoAllTokenDispatcher.token_combine`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference.moe.mappings import all_to_all, gather_tokens_over_tp, reduce_scatter_tokens_over_tp
from reference.moe.permute import sort_chunks
from reference.parallel_state import divide
from reference.tensor_parallel import collectives as C


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else group.size()


class AllToAllDispatcher:
    """The split sizes of one step, kept from `dispatch` for `combine`. No groups: the unsharded layer (EP 1,
    TP 1), where both are the identity."""

    def __init__(
        self, num_experts: int, ep_group: dist.ProcessGroup | None = None, tp_group: dist.ProcessGroup | None = None
    ):
        self.num_experts, self.ep_group, self.tp_group = num_experts, ep_group, tp_group
        self.num_local_experts = divide(num_experts, _size(ep_group), "num_experts", by="the expert-parallel size")

    def dispatch(self, permuted: torch.Tensor, tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """permuted [routed pairs, h] (expert-major), tokens_per_expert [E] -> (this rank's experts' rows, sorted
        by local expert, and how many each expert gets).

        Mirrors
        `megatron-lm:megatron/core/transformer/moe/token_dispatcher.py::MoEAlltoAllTokenDispatcher.preprocess`.
        """
        ep, tp, local = _size(self.ep_group), _size(self.tp_group), self.num_local_experts
        sent = tokens_per_expert.view(ep, local)  # [destination EP rank, its local expert]
        received = sent
        if ep > 1:  # 1. the counts: row j says how many rows EP rank j sends to each of my experts
            received = all_to_all(sent.flatten(), self.ep_group, [local] * ep, [local] * ep).view(ep, local)
        self.input_splits, self.output_splits = sent.sum(dim=1).tolist(), received.sum(dim=1).tolist()
        rows = permuted
        if ep > 1:  # 2. the tokens
            rows = all_to_all(rows, self.ep_group, self.output_splits, self.input_splits)
        if tp > 1:  # 3. expert TP: every TP peer's received rows, so each computes its slice of the experts
            received = C.gather_first_dim(received, self.tp_group)  # [tp * ep senders, local]
            self.tp_splits = received.view(tp, -1).sum(dim=1).tolist()
            rows = gather_tokens_over_tp(rows, self.tp_group, self.tp_splits)
        senders = received.shape[0]
        self.chunk_sizes = received.flatten().tolist()  # sender-major
        self.by_expert = [s * local + e for e in range(local) for s in range(senders)]
        return sort_chunks(rows, self.chunk_sizes, self.by_expert), received.sum(dim=0).tolist()

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """The experts' rows back to the ranks that sent them, in the order `permute` made there.

        Mirrors
        `megatron-lm:megatron/core/transformer/moe/token_dispatcher.py::MoEAlltoAllTokenDispatcher.token_combine`.
        """
        sizes_by_expert = [self.chunk_sizes[i] for i in self.by_expert]
        by_sender = sorted(range(len(self.by_expert)), key=self.by_expert.__getitem__)
        rows = sort_chunks(expert_output, sizes_by_expert, by_sender)
        if _size(self.tp_group) > 1:  # partial sums of each row's output: add them up, keep my rows
            rows = reduce_scatter_tokens_over_tp(rows, self.tp_group, self.tp_splits)
        if _size(self.ep_group) > 1:
            rows = all_to_all(rows, self.ep_group, self.input_splits, self.output_splits)
        return rows

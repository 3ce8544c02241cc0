"""Loss parallelism: cross-entropy over logits split on the vocabulary, never gathering them.

Each piece of loss = log(sum_v exp(z_v - m)) - (z_t - m), m = max_v z_v, is a reduction over the vocabulary,
so it is a local reduction over this rank's columns and an all-reduce of one number per token ([s, b], not
[s, b, V]): the max, the target logit, the sum of exponentials. Backward needs no communication.

Mirrors `megatron-lm:megatron/core/tensor_parallel/cross_entropy.py::_VocabParallelCrossEntropy`, with the same
three all-reduces in the same order; unlike it, pad columns are left out of the softmax, a target out of range
is refused, and the logits are not modified in place. The site's page on this module
(notes/reference/tensor_parallel.cross_entropy.md) derives it and lists each difference with its reason.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference.parallel_state import ParallelConfigError
from reference.tensor_parallel import collectives as C


def vocab_range(per_partition_vocab_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the vocabulary ids held by TP rank `rank`
    (megatron/core/tensor_parallel/utils.py::VocabUtility.vocab_range_from_per_partition_vocab_size).

    Mirrors `megatron-lm:megatron/core/tensor_parallel/utils.py::VocabUtility`.
    """
    start = rank * per_partition_vocab_size
    return start, start + per_partition_vocab_size


def check_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """Raise a one-line ParallelConfigError unless every id is an integer in [0, vocab_size).

    Ids on the meta device (reference.measure.scale traces shapes without values) have only their dtype checked."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ParallelConfigError(f"{what} must be integer token ids, got dtype {ids.dtype}")
    if not ids.numel() or ids.device.type == "meta":
        return
    low, high = torch.stack(torch.aminmax(ids)).tolist()  # one host sync (two with .min() and .max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ParallelConfigError(
            f"{what} holds id {bad}, outside the vocabulary [0, {vocab_size}); "
            f"check the tokenizer's vocabulary size against the model's"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: max / target-logit / exp-sum all-reduces over TP; backward: softmax - one_hot, locally.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/cross_entropy.py::_VocabParallelCrossEntropy`.
    """

    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        per_partition = logits.shape[-1]
        start, end = vocab_range(per_partition, group.rank())
        real = max(0, min(end, vocab_size) - start)  # this rank's columns that are real vocabulary entries
        logits = logits.float()  # fp32 softmax whatever the logits' dtype (Megatron: .float() too)

        # 1. global max per token, over real columns only (a shard of pure padding contributes -inf)
        if real > 0:
            logits_max = logits[..., :real].amax(dim=-1)
        else:
            logits_max = logits.new_full(logits.shape[:-1], float("-inf"))
        logits_max = C.all_reduce(logits_max, group, op=dist.ReduceOp.MAX)

        # 2. the target's shifted logit, read by the rank that owns the target's column
        target_mask = (target < start) | (target >= end)  # True: another rank owns this token's target
        local_target = (target - start).masked_fill(target_mask, 0)
        shifted = logits - logits_max.unsqueeze(-1)  # the one new logits-shard-sized buffer
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(target_mask, 0.0)
        predicted = C.all_reduce(predicted, group)

        # 3. the softmax denominator; padding columns get exp = 0 (excluded from the softmax)
        exp_logits = shifted.exp_()
        if real < per_partition:
            exp_logits[..., real:] = 0.0
        sum_exp = exp_logits.sum(dim=-1)
        sum_exp = C.all_reduce(sum_exp, group)

        loss = torch.log(sum_exp) - predicted
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))  # this rank's columns of the softmax, kept for backward
        ctx.save_for_backward(softmax, target_mask, local_target)
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.backward_done:  # the saved softmax is turned into the gradient in place (saves a buffer)
            raise RuntimeError(
                "vocab_parallel_cross_entropy: backward through the same loss twice (retain_graph) is not supported"
            )
        ctx.backward_done = True
        softmax, target_mask, local_target = ctx.saved_tensors
        grad = softmax  # d loss / d z_v = softmax_v - [v == t], then times the incoming gradient
        owned = (~target_mask).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, target: torch.Tensor, tp_group: dist.ProcessGroup, vocab_size: int | None = None
) -> torch.Tensor:
    """Per-token cross-entropy of vocabulary-split logits; the loss has target's shape, no reduction.

    logits_shard: [..., V_p / tp] this rank's contiguous slice of the (padded, V_p) vocabulary columns,
        e.g. [s, b, V_p / tp] from a ColumnParallelLinear with gather_output=False.
    target: [...] token ids in [0, vocab_size), the same on every TP rank.
    vocab_size: the real vocabulary size when V_p was padded up to a multiple of tp (default: V_p);
        the padding columns are excluded from the softmax.

    Megatron: megatron/core/tensor_parallel/cross_entropy.py::vocab_parallel_cross_entropy (which reads the
    TP group from global state; here it is passed in).
    """
    padded = logits_shard.shape[-1] * tp_group.size()
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ParallelConfigError(
            f"vocab_size {vocab_size} must be in [1, {padded}], the padded vocabulary "
            f"({logits_shard.shape[-1]} columns on each of {tp_group.size()} TP ranks)"
        )
    if target.shape != logits_shard.shape[:-1]:
        raise ParallelConfigError(
            f"target shape {tuple(target.shape)} does not match the logits' "
            f"{tuple(logits_shard.shape[:-1])} (logits are [..., vocab / tp])"
        )
    check_ids(target, vocab_size, "target")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, tp_group, vocab_size)

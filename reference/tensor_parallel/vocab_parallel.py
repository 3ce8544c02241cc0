"""The two ends of a language model split on the vocabulary: the input embedding and the output head + loss.

The vocabulary V is padded to V_p, a multiple of the TP size, and TP rank i holds rows [i V_p/p, (i+1) V_p/p)
of the embedding and of the output layer. The embedding zeroes the tokens another rank holds and sums over TP;
the head keeps its logit columns local for the loss-parallel cross-entropy, so no rank holds [s, b, V].

Mirrors `megatron-lm:megatron/core/tensor_parallel/layers.py::VocabParallelEmbedding` and
`megatron-lm:megatron/core/models/common/language_module/language_module.py::LanguageModule.compute_language_model_loss`.
Unlike Megatron, the padding is invisible: pad rows start at zero and pad logits stay out of the softmax
(notes/reference/tensor_parallel.vocab_parallel.md says how and why).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.parallel_state import ParallelConfigError
from reference.tensor_parallel.cross_entropy import check_ids, vocab_parallel_cross_entropy, vocab_range
from reference.tensor_parallel.layers import init_shard_from_master
from reference.tensor_parallel.linear_kernel import linear_with_grad_reduce
from reference.tensor_parallel.mappings import (
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def pad_vocab_size(vocab_size: int, tp_size: int, make_vocab_size_divisible_by: int = 1) -> int:
    """The smallest multiple of make_vocab_size_divisible_by * tp_size that is >= vocab_size.

    Megatron-LM: megatron/training/tokenizer/tokenizer.py::_vocab_size_with_padding (default multiple 128).
    """
    if vocab_size < 1 or tp_size < 1 or make_vocab_size_divisible_by < 1:
        raise ParallelConfigError(
            f"vocab size ({vocab_size}), tp size ({tp_size}) and "
            f"make_vocab_size_divisible_by ({make_vocab_size_divisible_by}) must be positive"
        )
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def padded_init_method(init_method: Callable[[torch.Tensor], object], vocab_size: int) -> Callable:
    """An init method for the [V_p, h] padded master: the first vocab_size rows drawn exactly as init_method
    draws an unpadded [vocab_size, h] weight, the pad rows zero."""

    def init(master: torch.Tensor) -> None:
        init_method(master[:vocab_size])  # contiguous leading rows: the same RNG draws as a fresh [V, h]
        with torch.no_grad():
            master[vocab_size:].zero_()

    return init


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by rows over TP: weight [V_p / p, h] holds the ids [vocab_start_index, vocab_end_index).

    num_embeddings: the real vocabulary size V (padded here to V_p = pad_vocab_size(V, p); Megatron expects
        the already padded size).
    forward(input_ids [b, s]) -> [b, s, h] (all-reduce over TP), or, with sequence_parallel, [s / p, b, h]
        (transposed to sequence-first, then reduce-scattered along the sequence), as Megatron's
        reduce_scatter_embeddings. Without it the caller transposes to [s, b, h], as Megatron's
        LanguageModelEmbedding does.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/layers.py::VocabParallelEmbedding`.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: dist.ProcessGroup,
        init_method: Callable,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        p = tp_group.size()
        self.vocab_size, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, tp_group
        self.padded_vocab_size = pad_vocab_size(num_embeddings, p)
        self.num_embeddings_per_partition = self.padded_vocab_size // p
        self.vocab_start_index, self.vocab_end_index = vocab_range(self.num_embeddings_per_partition, tp_group.rank())
        self.sequence_parallel = sequence_parallel and p > 1
        self.weight = torch.nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype, device=device)
        )
        init_shard_from_master(
            self.weight,
            self.padded_vocab_size,
            embedding_dim,
            0,
            padded_init_method(init_method, num_embeddings),
            tp_group,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        check_ids(input_ids, self.vocab_size, "VocabParallelEmbedding input")
        if self.tp_group.size() > 1:
            elsewhere = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
            local_ids = (input_ids - self.vocab_start_index).masked_fill(elsewhere, 0)
        else:
            local_ids = input_ids
        output_parallel = F.embedding(local_ids, self.weight)
        if self.tp_group.size() > 1:
            output_parallel = output_parallel.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            sequence_first = output_parallel.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
            return reduce_scatter_to_sequence_parallel_region(sequence_first, self.tp_group)
        return reduce_from_tensor_parallel_region(output_parallel, self.tp_group)


class LMHead(torch.nn.Module):
    """Output layer (no bias) + loss of a language model: hidden [s, b, h] -> per-token loss [b, s], no reduction
    (Megatron's compute_language_model_loss convention: the caller applies its loss mask and mean);
    logits(hidden) -> [s, b, V], or this rank's [s, b, V_p / p] when split.

    One definition for both ends of the oracle: without `tp_group` the weight is [V, h] and the loss torch's
    cross-entropy (the unsharded GPT's head); with one, the weight is this rank's rows [V_p / p, h] of the padded
    vocabulary, the logits stay split (a column-parallel linear with gather_output=False, its input all-gathered
    under `sequence_parallel`) and the loss is vocab_parallel_cross_entropy. Either way the weight is drawn like
    an unpadded nn.Linear(h, V, bias=False) from the same seed, pad rows zero.

    Mirrors
    `megatron-lm:megatron/core/models/common/language_module/language_module.py::LanguageModule.compute_language_model_loss`.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        init_method: Callable,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.vocab_size, self.tp_group = vocab_size, tp_group
        p = 1 if tp_group is None else tp_group.size()
        self.padded_vocab_size = vocab_size if tp_group is None else pad_vocab_size(vocab_size, p)
        self.sequence_parallel = sequence_parallel and p > 1
        rows = self.padded_vocab_size // p
        device = torch.get_default_device() if device is None else device
        self.weight = torch.nn.Parameter(torch.empty(rows, hidden_size, dtype=params_dtype, device=device))
        if tp_group is None:
            master = torch.empty(vocab_size, hidden_size, dtype=torch.float32)
            init_method(master)
            with torch.no_grad():
                self.weight.copy_(master)
        else:
            init = padded_init_method(init_method, vocab_size)
            init_shard_from_master(self.weight, self.padded_vocab_size, hidden_size, 0, init, tp_group)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return F.linear(hidden, self.weight)
        return linear_with_grad_reduce(
            hidden,
            self.weight,
            None,
            self.tp_group,
            allreduce_dgrad=self.tp_group.size() > 1 and not self.sequence_parallel,
            sequence_parallel=self.sequence_parallel,
        )

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            logits = self.logits(hidden).float()
            loss = F.cross_entropy(logits.flatten(0, 1), labels.transpose(0, 1).flatten(), reduction="none")
            return loss.view(logits.shape[:2]).transpose(0, 1)
        labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b], the logits' layout
        loss = vocab_parallel_cross_entropy(self.logits(hidden), labels, self.tp_group, self.vocab_size)
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s]

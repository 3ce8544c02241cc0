"""Activation recomputation: keep a region's inputs instead of everything it saves, and run it again in backward.

Per transformer block, Megatron's `recompute_granularity`: `none`; `selective`, the attention core (QK^T,
softmax, dropout, x V) keeps only its input, as
`megatron-lm:megatron/core/transformer/attention.py::Attention._checkpointed_attention_forward`; `full`, one
checkpoint per block, as
`megatron-lm:megatron/core/transformer/transformer_block.py::TransformerBlock._checkpointed_forward`.

The checkpoint is the reentrant one, `megatron-lm:megatron/core/tensor_parallel/random.py::checkpoint`, and it
replays the per-TP-rank dropout stream, so the gradients equal no recomputation's
(notes/reference/recompute.md says what each mode keeps and why the replay matters).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.checkpoint

from reference.parallel_state import ParallelConfigError
from reference.tensor_parallel.random import TensorParallelRNG

RECOMPUTE_MODES = ("none", "selective", "full")


def check_mode(mode: str) -> str:
    """The mode, or a one-line error naming the choices."""
    if mode not in RECOMPUTE_MODES:
        raise ParallelConfigError(f"unknown recompute mode {mode!r}; choose one of {', '.join(RECOMPUTE_MODES)}")
    return mode


def set_recompute(block: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Recompute `block` (a reference.tensor_parallel.transformer.Block) in backward: the whole layer ("full"),
    its attention core ("selective") or nothing ("none"), on the block's TP dropout stream if it has one."""
    block.recompute, block.attention.recompute = check_mode(mode), mode == "selective"
    return block


def _replaying(function: Callable, rng: TensorParallelRNG) -> Callable:
    """`function`, whose second and later calls (the recomputation in backward) start from the TP stream's
    state of the first call, and leave the stream as they found it.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/random.py::CheckpointFunction.backward`.
    """
    state_at_forward, calls = rng.state, 0

    def run(*args):
        nonlocal calls
        calls += 1
        if calls == 1:
            return function(*args)
        state_before = rng.state
        rng.state = state_at_forward
        try:
            return function(*args)
        finally:
            rng.state = state_before

    return run


def checkpoint(function: Callable, rng: TensorParallelRNG | None, *args: torch.Tensor) -> torch.Tensor:
    """function(*args), keeping only `args` for backward and recomputing the rest there, with the same
    dropout masks (default generators and the TP stream, if any, restored).

    Mirrors `megatron-lm:megatron/core/tensor_parallel/random.py::checkpoint`.
    """
    return torch.utils.checkpoint.checkpoint(
        function if rng is None else _replaying(function, rng), *args, use_reentrant=True, preserve_rng_state=True
    )


def recomputed(enabled: bool, rng: TensorParallelRNG | None, function: Callable, *args: torch.Tensor) -> torch.Tensor:
    """function(*args); `enabled`, in a forward that autograd records, checkpointed: the one dispatch of both
    modes, selective (the attention core) and full (the whole block)."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(function, rng, *args)
    return function(*args)

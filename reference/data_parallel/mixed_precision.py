"""Megatron's mixed precision optimizer: bf16 model parameters, fp32 master weights and optimizer states.

Forward and backward run in bf16 and the gradients are reduced in fp32 `main_grad`; the optimizer steps an fp32
master copy of each parameter and copies it back rounded to bf16, because small updates vanish in bf16's 8-bit
mantissa. `MasterWeightOptimizer` serves whole parameters and the distributed optimizer's slices alike. No loss
scaler: bf16 has fp32's exponent range.

Mirrors `megatron-lm:megatron/core/optimizer/optimizer.py::Float16OptimizerWithFloat16Params` and
`megatron-lm:megatron/core/optimizer/optimizer.py::MixedPrecisionOptimizer.step`
(notes/reference/data_parallel.mixed_precision.md has the copies step by step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from reference.data_parallel.wrapper import DistributedDataParallel

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
ModelChunks = DistributedDataParallel | list[DistributedDataParallel]


def model_chunks(model: ModelChunks) -> list[DistributedDataParallel]:
    """One DDP-wrapped model, or the v chunks of interleaved 1F1B: an optimizer steps them all, as Megatron's
    optimizers take `model_chunks`."""
    return model if isinstance(model, list) else [model]


class MasterWeightOptimizer:
    """An inner torch optimizer over fp32 masters of `pairs`' model tensors, fed by their fp32 gradients.

    Mirrors `megatron-lm:megatron/core/optimizer/optimizer.py::Float16OptimizerWithFloat16Params`.
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], make_optimizer: OptimizerFactory) -> None:
        self.model_tensors = [model for model, _ in pairs]
        self.grads = [grad for _, grad in pairs]
        self.masters = [
            model if model.dtype == torch.float32 else model.detach().clone().float() for model in self.model_tensors
        ]
        self.optimizer = make_optimizer(self.masters)

    @torch.no_grad()
    def step(self) -> None:
        """Masters take the gradients (a view when already fp32), step, and are copied back to the model.

        Mirrors
        `megatron-lm:megatron/core/optimizer/optimizer.py::Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads`,
        `megatron-lm:megatron/core/optimizer/optimizer.py::MixedPrecisionOptimizer.step`.
        """
        for master, grad in zip(self.masters, self.grads):
            master.grad = grad if grad.dtype == torch.float32 else grad.float()
        self.optimizer.step()
        for model, master in zip(self.model_tensors, self.masters):
            if model is not master:
                model.copy_(master)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the optimizer: fp32 masters that are copies, and the inner optimizer's
        per-element states (Adam: exp_avg, exp_avg_sq; its scalar `step` counters are not counted)."""
        masters = sum(m.numel() * m.element_size() for m, t in zip(self.masters, self.model_tensors) if m is not t)
        states = sum(
            value.numel() * value.element_size()
            for state in self.optimizer.state.values()
            for key, value in state.items()
            if torch.is_tensor(value) and key != "step"
        )
        return {"master_weights": masters, "optimizer_states": states}


def unsharded(model: ModelChunks, make_optimizer: OptimizerFactory) -> MasterWeightOptimizer:
    """Megatron's Float16OptimizerWithFloat16Params over a DDP model: every rank steps every parameter from
    its DP-averaged gradient (fp32 `main_grad` buckets, or bf16 `.grad` ones widened to fp32 at the step)."""
    chunks = model_chunks(model)
    if any(chunk.use_distributed_optimizer for chunk in chunks):
        raise ValueError(
            "unsharded(): the model was wrapped with use_distributed_optimizer=True, whose buckets "
            "are reduce-scattered; use reference.data_parallel.distributed_optimizer"
        )
    pairs = [(param, bucket.views[param]) for chunk in chunks for bucket in chunk.buckets for param in bucket.params]
    return MasterWeightOptimizer(pairs, make_optimizer)

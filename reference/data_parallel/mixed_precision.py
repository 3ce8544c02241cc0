"""Megatron's mixed precision optimizer: bf16 model parameters, fp32 master weights and optimizer states.

The forward and backward run in bf16; the gradients are accumulated and reduced in fp32 `main_grad`
(reference.data_parallel.buckets with `grad_dtype=torch.float32`). The optimizer never steps the bf16 tensors:
it steps an fp32 master copy of each, from the fp32 gradient, and copies the result back, rounded to bf16.
Small updates would otherwise vanish in bf16's 8-bit mantissa (an update below half an ulp of the weight
rounds to nothing), and Adam's moments need fp32 range.

`MasterWeightOptimizer(pairs, make_optimizer)` steps any list of (model tensor, fp32 gradient) pairs: the
whole parameters (`unsharded`, Megatron's Float16OptimizerWithFloat16Params) or this rank's slice of each
bucket (reference.data_parallel.distributed_optimizer). An fp32 model tensor is its own master (Megatron's
fp32 branch: no copy). Counterparts: megatron/core/optimizer/optimizer.py::Float16OptimizerWithFloat16Params
(`main_param = param.detach().clone().float()`, `_copy_model_grads_to_main_grads`: `main_param.grad =
model_param.main_grad.float()`, `_copy_main_params_to_model_params`) and ::MixedPrecisionOptimizer.step.
No loss scaler: bf16 has fp32's exponent range, so Megatron runs bf16 with none (grad_scaler None).
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

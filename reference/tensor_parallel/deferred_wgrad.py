"""The parallel linears' weight gradients, computed later: the backward in two that zero-bubble pipelines run.

While `store.collect(key)` is open, the backward of every linear (reference.tensor_parallel.linear_kernel)
computes and communicates its input gradient as always, but instead of its weight and bias gradients it stashes
the two tensors they are made of, its (under SP, gathered) input and its output gradient. `store.run(key)`
computes them later with the same expressions (`weight_gradients`, which the one-pass backward calls too) and
accumulates them through autograd, so that `.grad`, `main_grad` and the DP wrapper's post-accumulate hooks see
them as they would from one pass: the two passes give the one-pass gradients exactly. Every other parameter
(norms, embeddings, position table) gets its gradient in the first pass, with the input gradient.

The autograd graph is freed by the first pass; what W needs is held by the store, and only until it runs
(`held_tensors`, `held_bytes`: the memory the deferral costs).

Mirrors megatron-core's `delay_wgrad_compute`, where Transformer Engine's linears stash their wgrad inputs and
`megatron-lm:megatron/core/extensions/transformer_engine.py::TELinear.backward_dw` computes them. torch's
pipelining splits generically instead: `pytorch:torch/distributed/pipelining/_backward.py::stage_backward_input`
keeps the graph (retain_graph) and records the gradients reaching the nodes that lead to parameters, and
`pytorch:torch/distributed/pipelining/_backward.py::stage_backward_weight` resumes autograd from those nodes;
on a custom Function that computes both gradients at once, as this kernel's does, that would run it twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Hashable, Iterator

import torch

_collecting: tuple[WeightGradStore, Hashable, set[int]] | None = None  # store, key, ids of the parameters
# left for W so far; a global, not thread-local: autograd runs CUDA backwards on its own device threads


def weight_gradients(weight, use_bias: bool, total_x_2d, grad_out_2d, fusion: bool):
    """(dW, db) of Y = X W^T + b; with gradient-accumulation fusion dW goes straight into weight.main_grad
    (returned None). One definition for the one-pass backward and the deferred one."""
    if fusion:
        weight.main_grad.addmm_(grad_out_2d.t().to(weight.main_grad.dtype), total_x_2d.to(weight.main_grad.dtype))
        grad_weight = None
    else:
        grad_weight = grad_out_2d.t().matmul(total_x_2d)
    return grad_weight, grad_out_2d.sum(dim=0) if use_bias else None


@dataclasses.dataclass
class _Stashed:
    """One linear's call in the first pass: what its weight gradient needs."""

    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None
    total_x_2d: torch.Tensor
    grad_out_2d: torch.Tensor
    fusion: bool

    def accumulate(self) -> None:
        grads = weight_gradients(self.weight, self.bias is not None, self.total_x_2d, self.grad_out_2d, self.fusion)
        pairs = [(param, grad) for param, grad in zip((self.weight, self.bias), grads) if grad is not None]
        # backward from the leaves themselves: their AccumulateGrad adds as the one pass does, hooks included
        torch.autograd.backward([param for param, _ in pairs], [grad for _, grad in pairs])


class WeightGradStore:
    """The deferred weight gradients of one stage, by key (e.g. (chunk, micro-batch)), until each W runs."""

    def __init__(self):
        self.pending: dict[Hashable, list[_Stashed]] = {}

    @contextlib.contextmanager
    def collect(self, key: Hashable) -> Iterator[None]:
        """Around a first pass (I): the linears' weight gradients go to `key` instead of being computed."""
        global _collecting
        previous, _collecting = _collecting, (self, key, set())
        self.pending.setdefault(key, [])
        try:
            yield
        finally:
            _collecting = previous

    def run(self, key: Hashable) -> None:
        """W: compute and accumulate `key`'s weight gradients, and let go of what they held."""
        for stashed in self.pending.pop(key):
            stashed.accumulate()

    @property
    def held_tensors(self) -> int:
        return len(self._held())

    @property
    def held_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._held().values())

    def _held(self) -> dict[int, torch.Tensor]:
        """The tensors held, one per storage (a linear's input may be another's output gradient's neighbour)."""
        tensors = [t for stash in self.pending.values() for s in stash for t in (s.total_x_2d, s.grad_out_2d)]
        return {t.untyped_storage().data_ptr(): t for t in tensors}


def stash(weight, bias, total_x_2d, grad_out_2d, fusion: bool) -> bool:
    """Called by the linear's backward: hold its weight gradient's inputs if a first pass is collecting
    (True: do not compute them now)."""
    if _collecting is None:
        return False
    store, key, params = _collecting
    store.pending[key].append(_Stashed(weight, bias, total_x_2d, grad_out_2d, fusion))
    params.update(id(param) for param in (weight, bias) if param is not None)
    return True


def left_for_later(param: torch.nn.Parameter) -> bool:
    """Is `param`'s gradient left for W by the first pass running now? Its AccumulateGrad still runs, with no
    gradient, and fires the post-accumulate hooks: a DP wrapper must not count that as the gradient's arrival."""
    return _collecting is not None and id(param) in _collecting[2]

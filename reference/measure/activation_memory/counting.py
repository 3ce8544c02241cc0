"""Count the bytes a forward pass keeps for backward, with torch.autograd.graph.saved_tensors_hooks.

Every tensor an op saves for its backward (`ctx.save_for_backward`, an aten op's saved inputs and outputs)
passes through the pack hook. Counted: the bytes of its *storage*, once per storage, so a tensor saved by two
ops (a LayerNorm output that the next linear layer saves too) or several views of one buffer (Q, K and V cut
from the fused QKV output) count once, in their own dtype. Not counted: parameters (memory of the model, not
of the activations). Each record names the innermost module that was running when the tensor was saved, so
the caller can say which part of the layer it belongs to.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    module: str  # qualified name inside the counted module ("" for the module itself)
    dtype: str  # e.g. "torch.bfloat16"
    shape: tuple[int, ...]  # the saved tensor's shape (a view's, when it is a view)
    nbytes: int  # bytes of the storage it lives in, counted at its first save only


class SavedTensorCounter:
    """`with SavedTensorCounter(module) as counter: module(x)`; then `counter.saved` (in save order) and
    `counter.total_bytes`. Saved tensors are held until the counter is dropped, so no storage is freed and
    its address reused while counting (which would merge two storages)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.saved: list[SavedTensor] = []
        self._names = {m: name for name, m in module.named_modules()}
        self._running: list[str] = []
        self._counted = {self._storage_key(p) for p in module.parameters()}
        self._held: list[torch.Tensor] = []
        self._module_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @staticmethod
    def _storage_key(t: torch.Tensor) -> tuple[str, int]:
        return str(t.device), t.untyped_storage().data_ptr()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = self._storage_key(t)
        self._held.append(t)
        if key not in self._counted:
            self._counted.add(key)
            self.saved.append(
                SavedTensor(
                    self._running[-1] if self._running else "",
                    str(t.dtype),
                    tuple(t.shape),
                    t.untyped_storage().nbytes(),
                )
            )
        return t

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved)

    def __enter__(self) -> SavedTensorCounter:
        def enter(module, args):
            self._running.append(self._names[module])

        def leave(module, args, output):
            self._running.pop()

        for m in self._names:
            self._module_hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved_hooks.__exit__(*exc)
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks.clear()

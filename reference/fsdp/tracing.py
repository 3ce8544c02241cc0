"""Attribute the reference FSDP's collectives and compute to units in any active `CollectiveRecorder`.

Without a recorder these are no-ops. With one (`with CollectiveRecorder() as rec:` around the training
step), every all-gather and reduce-scatter is recorded under the unit it belongs to (a prefetched
all-gather under the unit it fetches, not the unit that issued it), and each unit's forward and backward
compute appears in `rec.spans` as "<unit> forward" / "<unit> backward", so the FSDP timeline can be drawn
from a real run. The backward span runs from the unit's pre-backward hook (after its all-gather landed)
to its post-backward hook (its gradient is complete).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from reference.recorder import CollectiveRecorder
from reference.torch_patches import FSDP1_SCOPES, available, fsdp1_runtime_wrapped


@contextlib.contextmanager
def unit_scope(unit_name: str) -> Iterator[None]:
    """Collectives issued inside are recorded with `module == unit_name`."""
    with contextlib.ExitStack() as stack:
        for recorder in CollectiveRecorder.active():
            stack.enter_context(recorder.scope(unit_name))
        yield


@contextlib.contextmanager
def forward_span(unit_name: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for recorder in CollectiveRecorder.active():
            stack.enter_context(recorder.span(f"{unit_name} forward"))
        yield


def backward_start() -> dict[int, tuple[float, int]]:
    """Where a unit's backward starts, for each active recorder: {id(recorder): recorder.mark()}."""
    return {id(recorder): recorder.mark() for recorder in CollectiveRecorder.active()}


def record_backward_span(unit_name: str, started: dict[int, tuple[float, int]]) -> None:
    """Close the unit's backward span that started at `started` (backward_start())."""
    for recorder in CollectiveRecorder.active():
        if id(recorder) in started:
            (start, flops), (end, flops_end) = started[id(recorder)], recorder.mark()
            recorder.add_span(f"{unit_name} backward", "backward", start, end, flops, flops_end)


@contextlib.contextmanager
def torch_fsdp1_unit_scopes(model: torch.nn.Module) -> Iterator[None]:
    """Attribute PyTorch FSDP1's collectives to units the same way, so both schedules compare line by line.

    FSDP1 issues every all-gather from pytorch:torch/distributed/fsdp/_runtime_utils.py::_unshard and every
    reduce-scatter from `_reduce_grad`; wrapping those two for the duration
    (reference.torch_patches.fsdp1_runtime_wrapped) scopes each collective under the unit its handle belongs to.
    Where the installed torch has no such functions, FSDP1 runs unscoped (one warning line).
    """
    if not available(FSDP1_SCOPES):
        yield
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    names = {
        id(unit._handle): clean_name(name) or "root"
        for name, unit in model.named_modules()
        if isinstance(unit, FullyShardedDataParallel) and unit._handle is not None
    }

    def in_unit_scope(original, state, handle, *args):
        with unit_scope(names.get(id(handle), "?")):
            return original(state, handle, *args)

    with fsdp1_runtime_wrapped(_unshard=in_unit_scope, _reduce_grad=in_unit_scope):
        yield


def clean_name(name: str) -> str:
    """A module name without FSDP1's wrapper prefix (both wrappers use `_fsdp_wrapped_module`)."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")

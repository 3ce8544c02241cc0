"""Attribute FSDP's collectives and compute to units in every active `CollectiveRecorder`: an observer.

`with unit_scopes(model) as prefetches:` around a step of a model sharded by the reference FSDP, PyTorch's
FSDP1, the reference FSDP2 or PyTorch's FSDP2. Each all-gather and reduce-scatter is recorded under the unit
(FSDP2: parameter group) it moves, by wrapping the runtime functions that issue them (the reference's `unshard`
and `reduce_grad`, FSDP1's `_unshard` and `_reduce_grad`, both FSDP2s' `unshard` and `post_backward`), so each
pair compares line by line; `prefetches` notes those a unit issued for another. Each unit's compute is recorded
as spans "<unit> forward" and "<unit> backward" (pre-backward hook to post-backward hook), and `issue_order`
interleaves them with the collectives."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator

import torch

from reference.fsdp import FullyShardedDataParallel, runtime
from reference.fsdp.wrapper import clean_name
from reference.fsdp2 import param_group
from reference.fsdp2.state import STATE_ATTR
from reference.measure.recorder import CollectiveRecorder
from reference.measure.torch_patches import (
    FSDP1_SCOPES,
    FSDP2_SCOPES,
    available,
    fsdp1_runtime_wrapped,
    fsdp2_param_group_wrapped,
    replaced,
)


@contextlib.contextmanager
def unit_scope(unit_name: str) -> Iterator[None]:
    """Collectives issued inside are recorded with `module == unit_name`."""
    with contextlib.ExitStack() as stack:
        for recorder in CollectiveRecorder.active():
            stack.enter_context(recorder.scope(unit_name))
        yield


class Prefetches:
    """The recorded all-gathers one unit issued for another (FSDP's prefetch): the recorder knows what was
    issued, only the runtime's prefetch call knows on whose behalf. Held weakly, as the recorder clears them."""

    def __init__(self) -> None:
        self._events: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(event) -> event

    def around(self, original, *args):
        """Wraps the runtime's prefetch function: what the recorders record inside it is a prefetch."""
        before = [(recorder, len(recorder.events)) for recorder in CollectiveRecorder.active()]
        result = original(*args)
        for recorder, count in before:
            self._events.update((id(event), event) for event in recorder.events[count:])
        return result

    def flags(self, recorder: CollectiveRecorder) -> list[bool]:
        """For each of `recorder.events`: was it a prefetch?"""
        return [id(event) in self._events for event in recorder.events]


def issue_order(recorder: CollectiveRecorder, prefetches: Prefetches) -> list[dict]:
    """The step's collectives and compute spans in the order this rank started them, e.g. all_gather root,
    all_gather layers.0 (prefetch), compute root, ... A unit's compute runs until the next entry, except a span
    that encloses other units' (the root: embedding before them, output layer and loss after), whose end is an
    entry "compute ends"."""
    timed = []
    for event, early in zip(recorder.events, prefetches.flags(recorder)):
        entry = {"phase": event.phase, "op": event.op, "unit": event.module, "nbytes": event.nbytes}
        timed.append((event.start, {**entry, "dtype": event.dtype, "prefetch": early}))
    for span in recorder.spans:
        unit = span.name.removesuffix(f" {span.phase}")
        timed.append((span.start, {"phase": span.phase, "op": "compute", "unit": unit}))
        if any(o is not span and span.start <= o.start and o.end <= span.end for o in recorder.spans):
            timed.append((span.end, {"phase": span.phase, "op": "compute ends", "unit": unit}))
    return [entry for _, entry in sorted(timed, key=lambda pair: pair[0])]


def unit_scopes(model: torch.nn.Module) -> contextlib.AbstractContextManager[Prefetches]:
    """Scope the collectives (and, for the reference FSDP, the compute) of `model`'s units while inside, and
    note which all-gathers were prefetches: by the first of the four FSDPs that wraps a module of `model`."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    modules = list(model.modules())
    for wraps, scopes in (
        (lambda m: isinstance(m, FullyShardedDataParallel), reference_fsdp_unit_scopes),
        (lambda m: isinstance(m, FSDP1), torch_fsdp1_unit_scopes),
        (lambda m: STATE_ATTR in m.__dict__, reference_fsdp2_unit_scopes),
        (lambda m: isinstance(m, FSDPModule), torch_fsdp2_unit_scopes),
    ):
        if any(map(wraps, modules)):
            return scopes(model)
    return contextlib.nullcontext(Prefetches())


@contextlib.contextmanager
def reference_fsdp_unit_scopes(model: torch.nn.Module) -> Iterator[Prefetches]:
    """The reference FSDP's units: scopes from reference.fsdp.runtime's functions (called through its module
    globals, so replacing them reaches every call) and compute spans from hooks on each unit's module."""
    prefetches, backward = Prefetches(), _BackwardSpans()
    in_unit_scope, pre_backward_hook, post_backward_hook = _fsdp1_arounds(
        backward, lambda handle: handle.name, lambda handle: handle.ran_pre_backward_hook, handle_at=1
    )
    with contextlib.ExitStack() as stack:
        for name, around in (
            ("unshard", in_unit_scope),
            ("reduce_grad", in_unit_scope),
            ("pre_backward_hook", pre_backward_hook),
            ("post_backward_hook", post_backward_hook),
            ("prefetch", prefetches.around),
        ):
            stack.enter_context(replaced(runtime, name, around))
        for unit in model.modules():
            if isinstance(unit, FullyShardedDataParallel):
                stack.enter_context(_forward_span(unit.module, functools.partial(_unit_name, unit)))
        yield prefetches


def _fsdp1_arounds(backward: _BackwardSpans, name_of: Callable, ran_of: Callable, handle_at: int) -> tuple:
    """What both FSDP1s wrap in their runtime (called with the unit or state, then the handle; the pre-backward
    hook's handle at `handle_at`): the collectives scoped under the handle's unit, and its backward span."""

    def in_unit_scope(original, owner, handle, *args):
        with unit_scope(name_of(handle)):
            return original(owner, handle, *args)

    def pre_backward_hook(original, *args):
        handle = args[handle_at]
        ran = bool(handle and ran_of(handle))
        grad = original(*args)
        if handle and not ran:
            backward.begin(handle)
        return grad

    def post_backward_hook(original, owner, handle, *args):
        backward.end(handle, name_of(handle))
        return original(owner, handle, *args)

    return in_unit_scope, pre_backward_hook, post_backward_hook


def _unit_name(unit: FullyShardedDataParallel) -> str:
    """A reference unit's name, known from its root's first forward (`_lazy_init`)."""
    return unit.handle.name if unit.handle else type(unit.module).__name__


class _BackwardSpans:
    """ "<unit> backward" spans: from the pre-backward hook that re-gathered the unit (its gradient computation
    starts) to its post-backward hook (its gradient is complete), in every active recorder."""

    def __init__(self) -> None:
        self._started: dict[int, dict[int, tuple[float, int]]] = {}  # id(handle) -> {id(recorder): mark()}

    def begin(self, handle) -> None:
        self._started[id(handle)] = {id(recorder): recorder.mark() for recorder in CollectiveRecorder.active()}

    def end(self, handle, name: str) -> None:
        begun = self._started.pop(id(handle), {})
        for recorder in CollectiveRecorder.active():
            if id(recorder) in begun:
                (start, flops), (end, flops_end) = begun[id(recorder)], recorder.mark()
                recorder.add_span(f"{name} backward", "backward", start, end, flops, flops_end)


@contextlib.contextmanager
def _forward_span(module: torch.nn.Module, name: Callable[[], str]) -> Iterator[None]:
    """A "<name()> forward" span around a unit's wrapped module's forward (after its all-gather landed)."""
    spans: list[contextlib.ExitStack] = []

    def open_span(_module, _args):
        stack = contextlib.ExitStack()
        for recorder in CollectiveRecorder.active():
            stack.enter_context(recorder.span(f"{name()} forward"))
        spans.append(stack)

    def close_span(_module, _args, _output):
        spans.pop().close()

    hooks = [module.register_forward_pre_hook(open_span), module.register_forward_hook(close_span, always_call=True)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def torch_fsdp1_unit_scopes(model: torch.nn.Module) -> Iterator[Prefetches]:
    """PyTorch FSDP1's units and compute spans, as the reference's, through
    `pytorch:torch/distributed/fsdp/_runtime_utils.py::_unshard`, `_reduce_grad`, `_prefetch_handle` and the
    backward hooks (reference.measure.torch_patches.fsdp1_runtime_wrapped); unscoped, with one warning line, where the
    installed torch has no such functions."""
    prefetches, backward = Prefetches(), _BackwardSpans()
    if not available(FSDP1_SCOPES):
        yield prefetches
        return
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    units = {clean_name(name) or "root": unit for name, unit in model.named_modules() if isinstance(unit, FSDP1)}
    names = {id(unit._handle): name for name, unit in units.items() if unit._handle is not None}
    in_unit_scope, pre_backward_hook, post_backward_hook = _fsdp1_arounds(
        backward,
        lambda handle: names.get(id(handle), "?"),
        lambda handle: getattr(handle, "_ran_pre_backward_hook", False),
        handle_at=2,  # _pre_backward_hook(state, module, handle, grad, ...)
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            fsdp1_runtime_wrapped(
                _unshard=in_unit_scope,
                _reduce_grad=in_unit_scope,
                _prefetch_handle=prefetches.around,
                _pre_backward_hook=pre_backward_hook,
                _post_backward_hook=post_backward_hook,
            )
        )
        for name, unit in units.items():
            stack.enter_context(_forward_span(unit.module, functools.partial(str, name)))
        yield prefetches


def _fsdp2_arounds(backward: _BackwardSpans, name_of: Callable, state_of: Callable) -> dict[str, Callable]:
    """What both FSDP2s wrap on their parameter group: `unshard` (its all-gather, also when another group
    prefetches it) and `post_backward` (its reduction) scoped under the group's name, and the backward span
    from the end of `pre_backward` (the group is unsharded, its prefetch issued) to `post_backward`."""

    def in_unit_scope(original, group, *args, **kwargs):
        with unit_scope(name_of(group)):
            return original(group, *args, **kwargs)

    def pre_backward(original, group, *args, **kwargs):
        ran = state_of(group).name == "PRE_BACKWARD"
        result = original(group, *args, **kwargs)
        if not ran:
            backward.begin(group)
        return result

    def post_backward(original, group, *args, **kwargs):
        backward.end(group, name_of(group))
        return in_unit_scope(original, group, *args, **kwargs)

    return {"unshard": in_unit_scope, "pre_backward": pre_backward, "post_backward": post_backward}


@contextlib.contextmanager
def reference_fsdp2_unit_scopes(model: torch.nn.Module) -> Iterator[Prefetches]:
    """The reference FSDP2's parameter groups: reference.fsdp2.param_group's `ParamGroup` methods and its
    `prefetch_unshard` (called through the module), and forward spans from hooks on each sharded module."""
    prefetches, backward = Prefetches(), _BackwardSpans()
    arounds = _fsdp2_arounds(backward, lambda group: group.name or "root", lambda group: group.training_state)
    with contextlib.ExitStack() as stack:
        for name, around in arounds.items():
            stack.enter_context(replaced(param_group.ParamGroup, name, around))
        stack.enter_context(replaced(param_group, "prefetch_unshard", prefetches.around))
        for name, module in model.named_modules():
            if STATE_ATTR in module.__dict__:
                stack.enter_context(_forward_span(module, functools.partial(str, name or "root")))
        yield prefetches


@contextlib.contextmanager
def torch_fsdp2_unit_scopes(model: torch.nn.Module) -> Iterator[Prefetches]:
    """PyTorch FSDP2's parameter groups, as the reference FSDP2's, through
    `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup.unshard`, `post_backward`,
    `pre_backward` and `_prefetch_unshard` (reference.measure.torch_patches.fsdp2_param_group_wrapped); unscoped, with
    one warning line, where the installed torch has no such methods."""
    from torch.distributed.fsdp import FSDPModule

    prefetches, backward = Prefetches(), _BackwardSpans()
    if not available(FSDP2_SCOPES):
        yield prefetches
        return
    arounds = _fsdp2_arounds(backward, lambda group: group._module_fqn or "root", lambda group: group._training_state)
    with contextlib.ExitStack() as stack:
        stack.enter_context(fsdp2_param_group_wrapped(prefetches.around, **arounds))
        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                stack.enter_context(_forward_span(module, functools.partial(str, name or "root")))
        yield prefetches

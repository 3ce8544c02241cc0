"""Every patch of torch internals the reference, its tests and its benchmarks make, and every private torch API
they call: written for one torch version, checked against the installed one.

Private names and call paths change between torch releases without notice, so each patch below first checks
that the installed torch is TORCH_VERSION (the version constraints.txt pins) and raises TorchVersionError
otherwise: one line, and a LaunchError, so the demos, benchmarks and test workers, which already print a
LaunchError as one line, refuse a different torch the same way. The private-API accessors at the end do not
check on every call (the recorder calls them per collective); the recorder checks once, on entry, through
`work_wait_observed`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C._distributed_c10d import ProcessGroup, Work
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.flop_counter import flop_registry

from reference.distributed import LaunchError

TORCH_VERSION = "2.13.0"


class TorchVersionError(LaunchError):
    """The installed torch is not the version these patches were written for."""


def require_pinned_torch() -> None:
    """Raise TorchVersionError (one line) unless the installed torch is TORCH_VERSION (any local build tag)."""
    installed = str(torch.__version__)
    if installed.split("+")[0] != TORCH_VERSION:
        raise TorchVersionError(
            f"reference/torch_patches.py is written for torch {TORCH_VERSION}, but torch "
            f"{installed} is installed; install torch=={TORCH_VERSION} (constraints.txt)"
        )


# ---- patches ---------------------------------------------------------------------------------------------
_WAIT_DESCRIPTOR = Work.__dict__["wait"]  # restored as is: pybind11 binds `self` through this descriptor
_original_wait = Work.wait
_wait_observers: list[Callable[[Work], None]] = []


def _observed_wait(self: Work, *args: Any, **kwargs: Any) -> Any:
    result = _original_wait(self, *args, **kwargs)
    for observer in list(_wait_observers):
        observer(self)
    return result


@contextlib.contextmanager
def work_wait_observed(after_wait: Callable[[Work], None]) -> Iterator[None]:
    """Call `after_wait(work)` each time any c10d `Work.wait()` returns, in this whole process, while inside.

    Why: the recorder stamps a collective's end when its caller's wait returns, and torch has no hook there
    (a Work's future completes when the backend is done, which can be before or after the caller waits; gloo's
    reduce-scatter has no future at all). Wraps `Work.wait`, the pybind11 binding of c10d::Work::wait in
    pytorch:torch/csrc/distributed/c10d/init.cpp, on the class, so that waits on Works created anywhere (the
    reference, megatron, FSDP) are seen. Nested uses share one wrapper; the binding is restored as it was when
    the last one exits.
    """
    require_pinned_torch()
    if not _wait_observers:
        Work.wait = _observed_wait
    _wait_observers.append(after_wait)
    try:
        yield
    finally:
        _wait_observers.remove(after_wait)
        if not _wait_observers:
            Work.wait = _WAIT_DESCRIPTOR


@contextlib.contextmanager
def _replaced(owner: Any, name: str, around: Callable[..., Any]) -> Iterator[None]:
    """`owner.name` becomes `lambda *a, **k: around(original, *a, **k)` while inside."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def replacement(*args: Any, **kwargs: Any) -> Any:
        return around(original, *args, **kwargs)

    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def fsdp1_runtime_wrapped(**arounds: Callable[..., Any]) -> Iterator[None]:
    """Run each named function of FSDP1's runtime through `around(original, *args, **kwargs)` while inside.

    Why: FSDP1 has no public hook at the points the kit observes: every all-gather is issued from
    pytorch:torch/distributed/fsdp/_runtime_utils.py::_unshard, every reduce-scatter from `_reduce_grad`, and
    the backward hooks are `_pre_backward_hook`, `_post_backward_hook` and `_post_backward_final_callback`.
    FSDP1 calls all of them through that module's globals (the hooks are bound when they are registered, in
    each forward), so replacing the module attribute reaches every call made inside the block.
    e.g. `fsdp1_runtime_wrapped(_unshard=lambda original, state, handle, *a: original(state, handle, *a))`.
    """
    require_pinned_torch()
    from torch.distributed.fsdp import _runtime_utils

    with contextlib.ExitStack() as stack:
        for name, around in arounds.items():
            if not callable(getattr(_runtime_utils, name, None)):
                raise TorchVersionError(f"torch {torch.__version__} has no _runtime_utils.{name} to wrap")
            stack.enter_context(_replaced(_runtime_utils, name, around))
        yield


@contextlib.contextmanager
def fsdp1_rate_limiter_wrapped(around: Callable[..., Any]) -> Iterator[None]:
    """Run FSDP1's rate limiter, `_FreeEventQueue.dequeue_if_needed(queue)`, through `around(original, queue)`.

    Why: whether `_unshard` had to wait for a freed all-gather buffer (limit_all_gathers) is visible only
    there: pytorch:torch/distributed/fsdp/_limiter_utils.py::_FreeEventQueue.dequeue_if_needed returns the
    event it synchronizes on, or None.
    """
    require_pinned_torch()
    from torch.distributed.fsdp._limiter_utils import _FreeEventQueue

    with _replaced(_FreeEventQueue, "dequeue_if_needed", around):
        yield


def cuda_calls_on_cpu() -> None:
    """For the rest of this process, `torch.cuda.current_device()` returns "cpu" and `torch.cuda.synchronize()`
    does nothing. Call it only in a process that runs on the CPU.

    Why: megatron-core allocates some buffers on `torch.cuda.current_device()` even with
    use_cpu_initialization (its gather and sequence-parallel paths in
    megatron-lm:megatron/core/tensor_parallel/layers.py), and its pipeline schedules call `torch.cuda.synchronize()`;
    redirected, megatron itself runs as an oracle on
    CPU/gloo. Replaces pytorch:torch/cuda/__init__.py::current_device and
    pytorch:torch/cuda/__init__.py::synchronize on the `torch.cuda` module, where megatron looks them up at each
    call.
    """
    require_pinned_torch()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None


# ---- private torch APIs, named once --------------------------------------------------------------------
def current_graph_task_id() -> int:
    """-1 unless the autograd engine is running a backward on this thread (torch._C._current_graph_task_id)."""
    return torch._C._current_graph_task_id()


def current_autograd_node() -> Any:
    """The autograd node executing now, or None (torch._C._current_autograd_node)."""
    return torch._C._current_autograd_node()


def autograd_sequence_nr() -> int:
    """The sequence number the next autograd node created on this thread gets
    (torch._C._autograd._get_sequence_nr); a node's own is `node._sequence_nr()`."""
    return torch._C._autograd._get_sequence_nr()


def node_sequence_nr(node: Any) -> int:
    """The sequence number autograd gave `node` when the forward created it (Node._sequence_nr)."""
    return node._sequence_nr()


def resolve_process_group(group_name: str) -> ProcessGroup:
    """The process group registered under `group_name` (functional collectives carry only the name)."""
    return torch._C._distributed_c10d._resolve_process_group(group_name)


def unbox_work(value: Any) -> Work:
    """The Work a c10d dispatcher op returned (boxed as a script object under a dispatch mode)."""
    return Work.unbox(value)


def unbox_process_group(value: Any) -> ProcessGroup:
    """The ProcessGroup a c10d dispatcher op was called with (boxed as a script object)."""
    return ProcessGroup.unbox(value)


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one aten op by torch's own formulas, the ones FlopCounterMode counts with
    (torch.utils.flop_counter.flop_registry); 0 for an op without one (CPU flash attention has none in 2.13)."""
    formula = flop_registry.get(func.overloadpacket)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


def dispatch_mode_stack() -> list:
    """The TorchDispatchModes active on this thread, innermost last (torch.utils._python_dispatch)."""
    return _get_current_dispatch_mode_stack()


def live_process_groups() -> list[ProcessGroup]:
    """Every process group torch holds, the default one included (distributed_c10d._world.pg_map): a group lives,
    and with gloo keeps a thread polling its sockets, until destroy_process_group(group), whoever forgot it."""
    return list(torch.distributed.distributed_c10d._world.pg_map)

"""Every patch of torch internals the reference, its tests and its benchmarks make, and every private torch API
they call, named once.

Private names change between torch releases without notice, so an observer that needs them asks first:
`available(RECORDER)` runs a probe that checks the names exist and behave as the observer uses them (as
torchtitan's check_if_feature_in_pytorch does), not the version string. When a probe fails, the observer turns
off with one warning line and the training runs unobserved; the mechanisms call none of this. A patch applied
without its probe raises MissingTorchFeature, one line.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed import ProcessGroup, Work
from torch.utils import flop_counter


class MissingTorchFeature(RuntimeError):
    """A private torch API a patch or an observer needs is absent from the installed torch, or behaves otherwise."""


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise MissingTorchFeature(f"torch {torch.__version__} {what}")


# ---- probes ----------------------------------------------------------------------------------------------
RECORDER = "the collective recorder (reference.measure.recorder)"
FSDP1_SCOPES = "FSDP1's unit scopes (reference.measure.fsdp_tracing)"
FSDP2_SCOPES = "FSDP2's unit scopes (reference.measure.fsdp_tracing)"
FSDP2_GROUP_METHODS = ("unshard", "pre_backward", "post_backward")  # methods of FSDPParamGroup the scopes wrap


def _probe_recorder() -> None:
    """Every private API CollectiveRecorder calls exists, and autograd numbers and names its nodes as the
    recorder reads them: outside backward no graph task runs; inside, the node running is the one the forward
    created, with the sequence number handed out then."""
    _require(callable(Work.__dict__.get("wait")), "has no Work.wait to observe")
    c10d, autograd = torch._C._distributed_c10d, torch._C._autograd
    for owner, name in [
        (Work, "unbox"),
        (ProcessGroup, "unbox"),
        (c10d, "_resolve_process_group"),
        (torch._C, "_current_graph_task_id"),
        (torch._C, "_current_autograd_node"),
        (autograd, "_get_sequence_nr"),
    ]:
        _require(callable(getattr(owner, name, None)), f"has no {owner.__name__}.{name}")
    _require(isinstance(getattr(flop_counter, "flop_registry", None), dict), "has no flop_counter.flop_registry")
    a = torch.ones(2, 3)
    _require(op_flops(torch.ops.aten.mm.default, (a, a.T), {}, a @ a.T) == 2 * 2 * 3 * 2, "counts mm FLOPs otherwise")
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.ones(2, requires_grad=True)
        lo = autograd_sequence_nr()
        y = x * 2
        hi = autograd_sequence_nr()
        seen = []
        y.register_hook(lambda grad: seen.append((current_graph_task_id(), node_sequence_nr(current_autograd_node()))))
        outside = current_graph_task_id()
        y.sum().backward()
    _require(outside == -1 and len(seen) == 1, "reports a graph task outside backward")
    task, seq = seen[0]
    _require(task != -1 and lo <= seq < hi, "numbers the autograd node running in backward otherwise")


def _probe_fsdp1_scopes() -> None:
    """FSDP1 issues its all-gathers and reduce-scatters from these module functions (prefetches through
    `_prefetch_handle`) and runs its backward hooks from the last two, wrapped by name."""
    from torch.distributed.fsdp import _runtime_utils

    for name in ("_unshard", "_reduce_grad", "_prefetch_handle", "_pre_backward_hook", "_post_backward_hook"):
        _require(callable(getattr(_runtime_utils, name, None)), f"has no fsdp._runtime_utils.{name} to wrap")


def _probe_fsdp2_scopes() -> None:
    """FSDP2 issues each group's all-gather from `FSDPParamGroup.unshard` (prefetches through the staticmethod
    `_prefetch_unshard`), its reductions from `post_backward`, and unshards for backward in `pre_backward`."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    for name in FSDP2_GROUP_METHODS:
        _require(callable(getattr(FSDPParamGroup, name, None)), f"has no FSDPParamGroup.{name} to wrap")
    _require(
        isinstance(FSDPParamGroup.__dict__.get("_prefetch_unshard"), staticmethod),
        "has no staticmethod FSDPParamGroup._prefetch_unshard to wrap",
    )


_PROBES = {RECORDER: _probe_recorder, FSDP1_SCOPES: _probe_fsdp1_scopes, FSDP2_SCOPES: _probe_fsdp2_scopes}


@functools.cache
def available(feature: str) -> bool:
    """Does `feature`'s probe pass on the installed torch? Probed once per process; when not, rank 0 says so in
    one warning line on stderr, and the caller runs without the feature."""
    try:
        _PROBES[feature]()
    except Exception as error:  # a probe's own failure, or whatever a changed API raised instead
        if int(os.environ.get("RANK", 0)) == 0:
            why = error if isinstance(error, MissingTorchFeature) else f"torch {torch.__version__}: {error!r}"
            print(f"reference: warning: {feature} is off: {str(why).splitlines()[0]}", file=sys.stderr, flush=True)
        return False
    return True


# ---- patches ---------------------------------------------------------------------------------------------
_WAIT_DESCRIPTOR = Work.__dict__.get("wait")  # restored as is: pybind11 binds `self` through this descriptor
_original_wait = getattr(Work, "wait", None)
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
    _require(callable(Work.__dict__.get("wait")), "has no Work.wait to observe")
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
def replaced(owner: Any, name: str, around: Callable[..., Any]) -> Iterator[None]:
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
    from torch.distributed.fsdp import _runtime_utils

    with contextlib.ExitStack() as stack:
        for name, around in arounds.items():
            _require(callable(getattr(_runtime_utils, name, None)), f"has no fsdp._runtime_utils.{name} to wrap")
            stack.enter_context(replaced(_runtime_utils, name, around))
        yield


@contextlib.contextmanager
def fsdp2_param_group_wrapped(prefetch: Callable[..., Any], **arounds: Callable[..., Any]) -> Iterator[None]:
    """Run each named method of FSDP2's `FSDPParamGroup` through `around(original, group, *args)`, and its
    staticmethod `_prefetch_unshard(target, pass_type)` through `prefetch(original, target, pass_type)`.

    Why: FSDP2 has no public hook where a group's collectives are issued:
    pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py::FSDPParamGroup.unshard issues the
    all-gather, `post_backward` the reduce-scatter (and HSDP's all-reduce), and `_prefetch_unshard` the early
    ones. Every call goes through the class, so replacing the class attributes reaches each group.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    _probe_fsdp2_scopes()
    static = FSDPParamGroup.__dict__["_prefetch_unshard"]

    def prefetch_unshard(*args: Any) -> Any:
        return prefetch(static.__func__, *args)

    with contextlib.ExitStack() as stack:
        for name, around in arounds.items():
            stack.enter_context(replaced(FSDPParamGroup, name, around))
        FSDPParamGroup._prefetch_unshard = staticmethod(prefetch_unshard)
        stack.callback(setattr, FSDPParamGroup, "_prefetch_unshard", static)
        yield


@contextlib.contextmanager
def fsdp1_rate_limiter_wrapped(around: Callable[..., Any]) -> Iterator[None]:
    """Run FSDP1's rate limiter, `_FreeEventQueue.dequeue_if_needed(queue)`, through `around(original, queue)`.

    Why: whether `_unshard` had to wait for a freed all-gather buffer (limit_all_gathers) is visible only
    there: pytorch:torch/distributed/fsdp/_limiter_utils.py::_FreeEventQueue.dequeue_if_needed returns the
    event it synchronizes on, or None.
    """
    from torch.distributed.fsdp._limiter_utils import _FreeEventQueue

    _require(callable(getattr(_FreeEventQueue, "dequeue_if_needed", None)), "has no _FreeEventQueue.dequeue_if_needed")
    with replaced(_FreeEventQueue, "dequeue_if_needed", around):
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
    formula = flop_counter.flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0
    if "scaled_dot_product" in func.overloadpacket.__name__:
        args = _as_many_heads(args)
    return int(formula(*args, **kwargs, out_val=out))


def _as_many_heads(args: tuple) -> tuple:
    """torch's attention formulas before 2.13 assert that key and value have the query's heads; grouped-query
    attention (a CUDA kernel taking fewer key/value heads) does the matmuls of them repeated, so count it so."""
    heads = max((a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4), default=0)
    return tuple(
        torch.empty((a.shape[0], heads, *a.shape[2:]), device="meta")
        if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] < heads
        else a
        for a in args
    )


def live_process_groups() -> list[ProcessGroup]:
    """Every process group torch holds, the default one included (distributed_c10d._world.pg_map): a group lives,
    and with gloo keeps a thread polling its sockets, until destroy_process_group(group), whoever forgot it."""
    return list(torch.distributed.distributed_c10d._world.pg_map)

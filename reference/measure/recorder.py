"""Record every collective a process issues: what, on which ranks, how many bytes, when, from where.

`CollectiveRecorder` is a `TorchDispatchMode`. Every `torch.distributed` call, whatever name it was bound
under, ends in a dispatcher op `c10d.*` (eager, returns a `Work`) or `_c10d_functional*.*` (functional
collectives, as DTensor uses), so intercepting those ops sees the reference and every oracle alike: the
interception point of torch's `CommDebugMode`, which only counts. This one also records sizes, groups,
phase, module, times and the FLOPs computed so far (torch's FLOP formulas, reference.measure.torch_patches.op_flops).
Each field's convention (`nbytes` is the full tensor's payload, `module` the innermost scope, forward or
backward) is on the site's page for this module (reading_notes/reference/measure.recorder.md.j2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from reference.measure import torch_patches

# dispatcher op name -> (normalized op, argument holding the full tensor(s), multiply its bytes by group size)
_OPS = {
    "c10d::allreduce_": ("all_reduce", "tensors", False),
    "c10d::allreduce_coalesced_": ("all_reduce", "tensors", False),
    "c10d::allgather_": ("all_gather", "input_tensors", True),
    "c10d::_allgather_base_": ("all_gather", "output_tensor", False),
    "c10d::allgather_coalesced_": ("all_gather", "input_list", True),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "outputs", False),
    "c10d::reduce_scatter_": ("reduce_scatter", "output_tensors", True),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "input_tensor", False),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", False),
    "c10d::broadcast_": ("broadcast", "tensors", False),
    "c10d::reduce_": ("reduce", "tensors", False),
    "c10d::gather_": ("gather", "input_tensors", True),
    "c10d::scatter_": ("scatter", "output_tensors", True),
    "c10d::alltoall_": ("all_to_all", "input_tensors", False),
    "c10d::alltoall_base_": ("all_to_all", "input", False),
    "c10d::send": ("send", "tensors", False),
    "c10d::recv_": ("recv", "tensors", False),
    "c10d::recv_any_source_": ("recv", "tensors", False),
    "c10d::barrier": ("barrier", None, False),
    "_c10d_functional::all_reduce": ("all_reduce", "input", False),
    "_c10d_functional::all_reduce_": ("all_reduce", "input", False),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", "inputs", False),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", "inputs", False),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "input", True),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "input", True),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "inputs", True),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "input", False),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", "input", False),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", False),
    "_c10d_functional::all_to_all_single": ("all_to_all", "input", False),
    "_c10d_functional::broadcast": ("broadcast", "input", False),
    "_c10d_functional::broadcast_": ("broadcast", "input", False),
    "_c10d_functional_autograd::all_gather_into_tensor": ("all_gather", "input", True),
    "_c10d_functional_autograd::reduce_scatter_tensor": ("reduce_scatter", "input", False),
    "_c10d_functional_autograd::all_to_all_single": ("all_to_all", "input", False),
}


@dataclasses.dataclass
class CollectiveEvent:
    """One collective as this rank issued it (see the module docstring for each field's convention)."""

    op: str
    group_ranks: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    dtype: str
    phase: str
    module: str
    start: float
    end: float | None
    async_op: bool
    num_tensors: int = 1
    flops: int = 0  # FLOPs computed under the recorder before this op was issued

    def key(self) -> tuple:
        """(op, group_ranks, shape, nbytes, dtype): what two implementations must agree on, timing aside."""
        return (self.op, self.group_ranks, self.shape, self.nbytes, self.dtype)


@dataclasses.dataclass
class Span:
    """A named compute interval (e.g. one unit's forward), for timelines drawn next to the collectives."""

    name: str
    phase: str
    start: float
    end: float
    flops_start: int = 0  # FLOPs computed under the recorder when the span opened, and when it closed
    flops_end: int = 0


def current_phase() -> str:
    return "backward" if torch_patches.current_graph_task_id() != -1 else "forward"


def _tensors(value) -> list[torch.Tensor]:
    """Flatten a Tensor, a list of Tensors or a list of lists of Tensors."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


_RECORDING: list[CollectiveRecorder] = []  # the recorders inside their `with`, innermost last


class CollectiveRecorder(TorchDispatchMode):
    """`with CollectiveRecorder() as rec: ...` then read `rec.events`, `rec.spans`, `rec.summary()`.
    Off (`rec.on` False: it records nothing) where the installed torch fails its probe.

    Mirrors `pytorch:torch/distributed/tensor/debug/_comm_mode.py::CommDebugMode`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[CollectiveEvent] = []
        self.spans: list[Span] = []
        self._stack: list[tuple[str, str]] = []  # (name, phase it was opened in)
        self._forward_ranges: list[tuple[int, int, str]] = []  # autograd seq-nr [lo, hi) -> scope name
        self._param_owner: dict[int, str] = {}  # id(parameter) -> name of the watched module holding it
        self._pending: dict[int, tuple[dist.Work, CollectiveEvent]] = {}  # id(Work) -> event awaiting wait()
        self._functional_pending: dict[int, CollectiveEvent] = {}  # id(output tensor) -> event
        self._group_ranks: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        self._wait_patches: list = []  # one per __enter__ (reference.measure.torch_patches.work_wait_observed)
        self.flops = 0  # FLOPs of every op run under the recorder so far
        self.on = torch_patches.available(torch_patches.RECORDER)

    # ---- scopes and spans ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Attribute collectives issued inside (and, for forward scopes, in the matching backward) to `name`."""
        phase = current_phase()
        lo = torch_patches.autograd_sequence_nr()
        self._stack.append((name, phase))
        try:
            yield
        finally:
            self._stack.pop()
            if phase == "forward":
                self._forward_ranges.append((lo, torch_patches.autograd_sequence_nr(), name))

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Record a compute span (name, phase, start, end, and the FLOPs at both ends) into `rec.spans`."""
        phase, (start, flops) = current_phase(), self.mark()
        try:
            yield
        finally:
            self.add_span(name, phase, start, time.perf_counter(), flops, self.flops)

    def mark(self) -> tuple[float, int]:
        """(time.perf_counter(), FLOPs so far): where a span starts."""
        return time.perf_counter(), self.flops

    def add_span(
        self, name: str, phase: str, start: float, end: float, flops_start: int = 0, flops_end: int = 0
    ) -> None:
        """Record a span whose ends are seen in different places (e.g. from one autograd hook to another)."""
        self.spans.append(Span(name, phase, start, end, flops_start, flops_end))

    @staticmethod
    def active() -> list[CollectiveRecorder]:
        """The recorders currently recording, innermost last (code that labels its work for any of them)."""
        return list(_RECORDING)

    def watch(self, model: torch.nn.Module, prefix: str = "") -> list:
        """Scope every submodule's forward under its qualified name; returns the hook handles."""
        handles = []
        for name, module in model.named_modules(prefix=prefix) if self.on else ():
            for param in module.parameters(recurse=False):
                self._param_owner[id(param)] = name
            if not name:
                continue
            scopes: list = []

            def enter(_mod, _inp, name=name, scopes=scopes):
                scopes.append(self.scope(name))
                scopes[-1].__enter__()

            def leave(_mod, _inp, _out, scopes=scopes):
                scopes.pop().__exit__(None, None, None)

            # first pre-hook and last post-hook, so that collectives issued by other hooks (FSDP's unshard and
            # reshard) fall inside the scope; always_call pops the scope even if forward raises
            handles += [
                module.register_forward_pre_hook(enter, prepend=True),
                module.register_forward_hook(leave, always_call=True),
            ]
        return handles

    def _module(self, phase: str) -> str:
        if phase == "backward":
            opened_in_backward = [n for n, p in self._stack if p == "backward"]
            if opened_in_backward:
                return opened_in_backward[-1]
            node = torch_patches.current_autograd_node()
            variable = getattr(node, "variable", None)  # an AccumulateGrad node: a hook on a parameter's grad
            if variable is not None and id(variable) in self._param_owner:
                return self._param_owner[id(variable)]
            if node is not None:
                seq = torch_patches.node_sequence_nr(node)
                # narrowest range wins; on a tie the scope that closed first (the inner one)
                inside = [(hi - lo, i, n) for i, (lo, hi, n) in enumerate(self._forward_ranges) if lo <= seq < hi]
                if inside:
                    return min(inside)[2]
        return self._stack[-1][0] if self._stack else ""

    # ---- interception --------------------------------------------------------------------------------
    def __enter__(self):
        if not self.on:
            return self
        waits = torch_patches.work_wait_observed(lambda work: self._finish(id(work), from_wait=True))
        waits.__enter__()
        self._wait_patches.append(waits)
        _RECORDING.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        if not self.on:
            return False
        _RECORDING.remove(self)  # the same recorder entered twice is listed twice: this removes one
        self._wait_patches.pop().__exit__(None, None, None)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name == "_c10d_functional::wait_tensor":
            out = func(*args, **kwargs)
            event = self._functional_pending.pop(id(args[0]), None)
            if event is not None:
                event.end = time.perf_counter()
            return out
        spec = _OPS.get(name)
        if spec is None:
            out = func(*args, **kwargs)
            self.flops += torch_patches.op_flops(func, args, kwargs, out)
            return out
        names, defaults = _schema_arguments(func)
        named = {**defaults, **dict(zip(names, args)), **kwargs}
        phase, start = current_phase(), time.perf_counter()
        out = func(*args, **kwargs)
        event = self._event(name, spec, named, out, phase, start)
        self.events.append(event)
        if name.startswith("c10d::"):
            work = torch_patches.unbox_work(out[-1] if isinstance(out, tuple) else out)
            if work is None:  # done already (NCCL on a group of one returns no Work)
                event.end = time.perf_counter()
                return out
            work_id = id(work)  # unique while pending: the entry keeps the Work alive
            with self._lock:
                self._pending[work_id] = (work, event)
            try:
                future = work.get_future()
            except RuntimeError:  # e.g. gloo's reduce-scatter work has no future: only wait() stamps the end
                future = None
            if future is not None:
                future.add_done_callback(lambda _future: self._finish(work_id, from_wait=False))
        else:
            event.end = time.perf_counter()
            if isinstance(out, torch.Tensor):
                self._functional_pending[id(out)] = event
        return out

    def _event(self, name, spec, named, out, phase, start) -> CollectiveEvent:
        op, arg, times_group = spec
        ranks = self._ranks(named)
        tensors = _tensors(named[arg]) if arg else []
        factor = len(ranks) if times_group else 1
        first = tensors[0] if tensors else None
        shape = tuple(first.shape) if first is not None else ()
        if factor > 1 and shape:
            shape = (shape[0] * factor, *shape[1:])
        return CollectiveEvent(
            op=op,
            group_ranks=ranks,
            shape=shape,
            nbytes=factor * sum(t.nbytes for t in tensors),
            dtype=str(first.dtype).removeprefix("torch.") if first is not None else "",
            phase=phase,
            module=self._module(phase),
            start=start,
            end=None,
            async_op=bool(named.get("async_op", not name.startswith("c10d::"))),
            num_tensors=len(tensors),
            flops=self.flops,
        )

    def _ranks(self, named) -> tuple[int, ...]:
        """The group's global ranks, looked up once per group: eager c10d ops carry the group itself,
        functional ones its name (a fake-backend WORLD of thousands would otherwise be listed per op)."""
        if "process_group" in named:
            group = torch_patches.unbox_process_group(named["process_group"])
            group_name = group.group_name
        else:
            group, group_name = None, named["group_name"]
            group_name = group_name if isinstance(group_name, str) else str(group_name)
        ranks = self._group_ranks.get(group_name)
        if ranks is None:
            group = group or torch_patches.resolve_process_group(group_name)
            ranks = self._group_ranks[group_name] = tuple(dist.get_process_group_ranks(group))
        return ranks

    def _finish(self, work_id: int, from_wait: bool) -> None:
        with self._lock:
            entry = self._pending.get(work_id)
            if entry is None:
                return
            if from_wait:
                del self._pending[work_id]
        if from_wait or entry[1].end is None:
            entry[1].end = time.perf_counter()

    # ---- results -------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget recorded events and spans (e.g. between steps); scopes stay."""
        self.events.clear()
        self.spans.clear()
        self.flops = 0
        self._forward_ranges.clear()
        self._functional_pending.clear()
        with self._lock:
            self._pending.clear()

    def summary(self, phase: str | None = None, events=None) -> dict[str, dict[str, int]]:
        """{op: {"count": n, "bytes": total nbytes}} over `events` (default: all), optionally one phase only."""
        out: dict[str, dict[str, int]] = {}
        for e in self.events if events is None else events:
            if phase is None or e.phase == phase:
                entry = out.setdefault(e.op, {"count": 0, "bytes": 0})
                entry["count"] += 1
                entry["bytes"] += e.nbytes
        return out

    def summary_by_group(
        self, kind_of: Callable[[tuple[int, ...]], str], kinds: tuple[str, ...] = ()
    ) -> dict[str, dict[str, dict[str, int]]]:
        """{kind: summary()} of this rank's events by the group each ran on, named by `kind_of(group_ranks)`
        (e.g. ParallelLayout.group_kind: "tp", "pp", "dp", else "other"); `kinds` come first, even if empty."""
        by_kind: dict[str, list[CollectiveEvent]] = {kind: [] for kind in kinds}
        for event in self.events:
            by_kind.setdefault(kind_of(event.group_ranks), []).append(event)
        return {kind: self.summary(events=events) for kind, events in by_kind.items()}

    def to_dict(self) -> dict:
        """Plain data for JSON and the notes' diagram generator; times are relative to the first record."""
        t0 = min([e.start for e in self.events] + [s.start for s in self.spans], default=0.0)
        rel = lambda t: None if t is None else t - t0
        rank = dist.get_rank() if dist.is_initialized() else 0
        return {
            "rank": rank,
            "events": [{**dataclasses.asdict(e), "start": rel(e.start), "end": rel(e.end)} for e in self.events],
            "spans": [{**dataclasses.asdict(s), "start": rel(s.start), "end": rel(s.end)} for s in self.spans],
            "summary": self.summary(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


@functools.cache
def _schema_arguments(func) -> tuple[list[str], dict]:
    """An op's argument names and defaults, read from its schema once (not on every collective)."""
    arguments = func._schema.arguments
    return [a.name for a in arguments], {
        a.name: (a.default_value if a.has_default_value() else None) for a in arguments
    }

"""What the FSDP close reading and its check-yourself answers claim, shown on PyTorch FSDP1 itself (torch 2.13.0).

At world 2 on CPU/gloo, the first test to ask trains the test GPT (reference.gpt.model.GPT, one FSDP1
unit per layer, then the root) three steps with FSDP1's defaults and with each option the note discusses, under
one CollectiveRecorder (`recorded()`, once a rank); each test asserts on what its rank recorded. The only option
every configuration sets is device_id=cpu: FSDP1 refuses a CPU module without it.
Units in forward order: root (embedding, final LayerNorm, output layer and loss; its forward encloses the
layers'), layers.0-2. Prefetch claims are checked from step 1 on (step 0 records the forward order).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from reference.fsdp.wrapper import clean_name
from reference.gpt.model import GPT, GPTConfig
from reference.gpt.train import split_batch, synthetic_batches
from reference.measure.fsdp_tracing import torch_fsdp1_unit_scopes
from reference.measure.recorder import CollectiveRecorder, current_phase
from reference.measure.torch_patches import fsdp1_rate_limiter_wrapped, fsdp1_runtime_wrapped
from study.estimates import training_memory
from tests.ranks import on_ranks
from tests.reference.helpers import every_rank

pytestmark = pytest.mark.upstream("pytorch")

WORLD = 2
CONFIG = GPTConfig(vocab_size=101, hidden_size=27, num_attention_heads=3, num_layers=3, seq_length=16)
STEPS, BATCH, SEED = 3, 4, 7
LAYERS = [f"layers.{i}" for i in range(CONFIG.num_layers)]  # FSDP1's units below the root
BF16 = torch.bfloat16
CONFIGS = {  # name -> FSDP1 options besides device_id
    "default": {},
    "forward_prefetch": {"forward_prefetch": True},
    "backward_post": {"backward_prefetch": BackwardPrefetch.BACKWARD_POST},
    "backward_none": {"backward_prefetch": None},
    "no_rate_limit": {"limit_all_gathers": False},
    "use_orig_params": {"use_orig_params": True},
    "mixed": {"mixed_precision": MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32, buffer_dtype=BF16)},
    "mixed_param_only": {"mixed_precision": MixedPrecision(param_dtype=BF16)},
}


class UnusedBranch(nn.Module):
    """Three units a, b, c; b runs in forward but its output never reaches the loss, so the backward prefetch
    that c's pre-backward issues for b (the unit before c in forward order) is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.a(x)
        self.b(hidden)
        return self.c(hidden)


def wrap(model: nn.Module, children: list[str], **options) -> FSDP:
    """FSDP1 on each named child, then on the root: the note's units."""
    for name in children:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, FSDP(getattr(owner, attr), device_id=torch.device("cpu"), **options))
    return FSDP(model, device_id=torch.device("cpu"), **options)


def units(model: FSDP) -> dict[str, FSDP]:
    return {clean_name(name) or "root": m for name, m in model.named_modules() if isinstance(m, FSDP) and m._handle}


def flags(handle) -> dict[str, bool]:
    return {
        "gathered": handle.flat_param._full_param_padded.untyped_storage().size() > 0,
        "prefetched": handle._prefetched,
        "needs_pre_forward": handle._needs_pre_forward_unshard,
        "needs_pre_backward": handle._needs_pre_backward_unshard,
    }


class HookLog:
    """Spans of FSDP1's hooks and the units' flags at their ends, for one model (see run_config)."""

    def __init__(self, model: FSDP, recorder: CollectiveRecorder) -> None:
        self.units, self.recorder = units(model), recorder
        self.names = {id(unit._handle): name for name, unit in self.units.items()}
        self.marks: list[dict] = []
        self.waits = 0

    def mark(self, at: str) -> None:
        self.marks.append(
            {
                "at": at,
                "t": time.perf_counter(),
                "units": {name: flags(unit._handle) for name, unit in self.units.items()},
            }
        )

    @contextlib.contextmanager
    def span(self, name: str):
        phase, start = current_phase(), time.perf_counter()
        try:
            yield
        finally:
            self.recorder.add_span(name, phase, start, time.perf_counter())
            self.mark(name)

    def clear(self) -> None:
        self.marks.clear()
        self.waits = 0

    @contextlib.contextmanager
    def installed(self):
        """Module hooks around each unit's forward; FSDP1's backward hooks and rate limiter wrapped (they are
        looked up in their module's globals when registered or called, like torch_fsdp1_unit_scopes's)."""
        started: dict[str, float] = {}
        hooks = []
        for name, unit in self.units.items():
            inner = unit._fsdp_wrapped_module

            def outer_pre(_m, _a, name=name):
                started[name] = time.perf_counter()

            def inner_pre(_m, _a, name=name):
                self._close(f"{name} pre-forward", started, name)

            def inner_post(_m, _a, _o, name=name):
                self._close(f"{name} forward", started, name)

            def outer_post(_m, _a, _o, name=name):
                self._close(f"{name} post-forward", started, name)

            hooks += [
                unit.register_forward_pre_hook(outer_pre, prepend=True),
                inner.register_forward_pre_hook(inner_pre),
                inner.register_forward_hook(inner_post, prepend=True),
                unit.register_forward_hook(outer_post),
            ]

        def pre_backward_hook(pre_backward, state, module, handle, *args):
            if handle is None or getattr(handle, "_ran_pre_backward_hook", False):
                return pre_backward(state, module, handle, *args)
            with self.span(f"{self.names[id(handle)]} pre-backward"):
                return pre_backward(state, module, handle, *args)

        def post_backward_hook(post_backward, state, handle, *args):
            with self.span(f"{self.names[id(handle)]} post-backward"):
                return post_backward(state, handle, *args)

        def final_callback_hook(final_callback, state, module):
            self.mark("final callback start")
            with self.span("final callback"):
                return final_callback(state, module)

        def dequeue_if_needed(dequeue, queue):
            event = dequeue(queue)
            self.waits += event is not None
            return event

        with contextlib.ExitStack() as stack:
            stack.enter_context(
                fsdp1_runtime_wrapped(
                    _pre_backward_hook=pre_backward_hook,
                    _post_backward_hook=post_backward_hook,
                    _post_backward_final_callback=final_callback_hook,
                )
            )
            stack.enter_context(fsdp1_rate_limiter_wrapped(dequeue_if_needed))
            for hook in hooks:
                stack.callback(hook.remove)
            yield

    def _close(self, span: str, started: dict[str, float], unit: str) -> None:
        now = time.perf_counter()
        self.recorder.add_span(span, current_phase(), started[unit], now)
        self.mark(span)
        started[unit] = now


def parameter_table(module: nn.Module) -> list[list]:
    """[name, type, shape, dtype] of each registered parameter entry (FSDP1 may put plain tensors there)."""
    return [
        [clean_name(f"{prefix}.{name}" if prefix else name), type(p).__name__, list(p.shape), str(p.dtype)]
        for prefix, sub in module.named_modules()
        for name, p in sub._parameters.items()
        if p is not None
    ]


def run_config(options: dict, initial: nn.Module, recorder: CollectiveRecorder, rank: int, world: int):
    """One configuration's steps and its parameters' views; per step:
    events  every all-gather and reduce-scatter (op, unit, phase, bytes, dtype, issue time), attributed to the
            unit whose flat parameter it moves (reference.measure.fsdp_tracing.torch_fsdp1_unit_scopes);
    spans   "<unit> pre-forward" (the FSDP module's call up to its wrapped module's forward), "<unit> forward",
            "<unit> post-forward", "<unit> pre-backward" and "<unit> post-backward" (FSDP1's `_pre_backward_hook` /
            `_post_backward_hook` calls that run), "final callback" (`_post_backward_final_callback`);
    marks   at the end of each span (and the start of the final callback), every unit's `_prefetched`,
            `_needs_pre_forward_unshard`, `_needs_pre_backward_unshard` and whether its unsharded flat parameter
            is allocated ("gathered");
    waits   how many times `_unshard`'s rate limiter took a free event to synchronize.
    """
    model = copy.deepcopy(initial)
    model.register_buffer("scale", torch.ones(()))  # a floating buffer for buffer_dtype (unused by forward)
    model = wrap(model, LAYERS, **options)
    log = HookLog(model, recorder)
    seen: dict = {}
    layer0 = log.units["layers.0"]._fsdp_wrapped_module

    def peek_in_forward(module, _args):  # the first step's views, after FSDP1's pre-forward
        seen.setdefault("in_forward", {"parameters": parameter_table(module), "buffer_dtype": str(model.scale.dtype)})

    peek = layer0.register_forward_pre_hook(peek_in_forward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    with log.installed(), torch_fsdp1_unit_scopes(model):
        for tokens in synthetic_batches(CONFIG, STEPS, BATCH, SEED):
            ((inputs, labels),) = split_batch(tokens, world, rank, 1)
            recorder.clear()
            log.clear()
            model(inputs, labels).backward()
            grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
            optimizer.step()
            optimizer.zero_grad()
            steps.append(
                {
                    "events": [
                        {
                            "op": e.op,
                            "unit": e.module,
                            "phase": e.phase,
                            "nbytes": e.nbytes,
                            "dtype": e.dtype,
                            "start": e.start,
                        }
                        for e in recorder.events
                    ],
                    "spans": {s.name: [s.start, s.end] for s in recorder.spans},
                    "marks": list(log.marks),
                    "waits": log.waits,
                    "grad_dtypes": grad_dtypes,
                }
            )
    peek.remove()
    flat = {
        name: {
            "numel": unit._handle.flat_param._unpadded_unsharded_size.numel(),
            "padded_numel": unit._handle.flat_param._padded_unsharded_size.numel(),
            "shard_numel": unit._handle.flat_param._sharded_size.numel(),
            "original_parameters": len(unit._handle.flat_param._fqns),
        }
        for name, unit in log.units.items()
    }
    return {
        "steps": steps,
        "units": flat,
        "in_forward": seen["in_forward"],
        "outside_forward": {"parameters": parameter_table(model), "buffer_dtype": str(model.scale.dtype)},
    }


def unused_branch(recorder: CollectiveRecorder) -> list[dict]:
    """Marks of two default-option steps of UnusedBranch."""
    torch.manual_seed(SEED)
    model = wrap(UnusedBranch(), ["a", "b", "c"])
    log = HookLog(model, recorder)
    steps = []
    with log.installed(), torch_fsdp1_unit_scopes(model):
        for _ in range(2):
            log.clear()
            model(torch.randn(4, 8)).sum().backward()
            steps.append({"marks": list(log.marks)})
    return steps


def adam_bytes(model: nn.Module, optimizer: torch.optim.Adam) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and Adam's two moments (its step counters aside)."""
    size = lambda t: t.numel() * t.element_size()
    return {
        "params": sum(size(p) for p in model.parameters()),
        "grads": sum(size(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer": sum(size(s[k]) for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")),
    }


def memory(initial: nn.Module, rank: int, world: int) -> dict:
    """Per-rank bytes after one Adam step under torch DDP and under default FSDP1."""
    result = {"params": sum(p.numel() for p in initial.parameters()), "units": 1 + CONFIG.num_layers}
    for kind in ("ddp", "fsdp"):
        model = copy.deepcopy(initial)
        model = nn.parallel.DistributedDataParallel(model) if kind == "ddp" else wrap(model, LAYERS)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        ((inputs, labels),) = split_batch(synthetic_batches(CONFIG, 1, BATCH, SEED)[0], world, rank, 1)
        model(inputs, labels).backward()
        optimizer.step()
        result[kind] = adam_bytes(model, optimizer)
    return result


@functools.cache
def recorded() -> dict:
    """This rank's recorded steps of every configuration, the unused-branch run and the memory figures."""
    rank, world = dist.get_rank(), dist.get_world_size()
    initial = GPT(CONFIG, SEED)
    result: dict = {"runs": {}}
    with CollectiveRecorder() as recorder:
        for name, options in CONFIGS.items():
            result["runs"][name] = run_config(options, initial, recorder, rank, world)
        result["unused_branch"] = unused_branch(recorder)
    result["memory"] = memory(initial, rank, world)
    return result


FORWARD_PAIRS = list(zip(["root"] + LAYERS[:-1], LAYERS))  # (unit l, unit l+1)
BACKWARD_PAIRS = [("root", "layers.2"), ("layers.2", "layers.1"), ("layers.1", "layers.0")]  # (current, next)


def steps(config: str, first: int = 1):
    """This rank's recorded steps of one configuration, from step `first` on."""
    yield from recorded()["runs"][config]["steps"][first:]


def issued(step: dict, op: str, unit: str, phase: str) -> float:
    starts = [e["start"] for e in step["events"] if (e["op"], e["unit"], e["phase"]) == (op, unit, phase)]
    assert len(starts) == 1, f"expected one {phase} {op} of {unit}, found {len(starts)}"
    return starts[0]


def inside(step: dict, time: float, span: str) -> bool:
    start, end = step["spans"][span]
    return start <= time <= end


def mark(step: dict, at: str) -> dict:
    found = [m["units"] for m in step["marks"] if m["at"] == at]
    assert len(found) == 1, f"expected one mark {at!r}, found {len(found)}"
    return found[0]


def gathered(units: dict) -> set[str]:
    return {name for name, unit in units.items() if unit["gathered"]}


@on_ranks(WORLD)
def test_one_allgather_and_one_reduce_scatter_per_unit_of_many_parameters(ranks):
    """Each unit's parameters travel as one padded flat parameter: per step, one all-gather per pass that
    needs them and one reduce-scatter, of padded size (N equal shards), whatever the number of tensors."""
    result = recorded()
    units = result["runs"]["default"]["units"]
    for step in result["runs"]["default"]["steps"]:
        for name, unit in units.items():
            assert unit["original_parameters"] > 1
            assert unit["shard_numel"] * WORLD == unit["padded_numel"] < unit["numel"] + WORLD
            events = [(e["op"], e["nbytes"]) for e in step["events"] if e["unit"] == name]
            gathers = 1 if name == "root" else 2
            assert events == [("all_gather", unit["padded_numel"] * 4)] * gathers + [
                ("reduce_scatter", unit["padded_numel"] * 4)
            ]


@on_ranks(WORLD)
def test_default_gathers_each_unit_in_its_own_pre_forward_after_the_previous_computed(ranks):
    """forward_prefetch=False: unit l+1's all-gather is issued from its own pre-forward, once unit l's
    forward has returned; every step, not only the first."""
    for step in steps("default", first=0):
        for current, following in FORWARD_PAIRS:
            gather = issued(step, "all_gather", following, "forward")
            assert inside(step, gather, f"{following} pre-forward")
            if current != "root":  # the root's forward encloses the layers'
                assert gather > step["spans"][f"{current} forward"][1]


@on_ranks(WORLD)
def test_forward_prefetch_gathers_next_unit_from_current_pre_forward(ranks):
    """forward_prefetch=True: from the second step, unit l's pre-forward issues unit l+1's all-gather right
    after its own, before unit l computes; the first step, which records the order, cannot."""
    for step in steps("forward_prefetch"):
        for current, following in FORWARD_PAIRS:
            gather = issued(step, "all_gather", following, "forward")
            assert inside(step, gather, f"{current} pre-forward")
            assert issued(step, "all_gather", current, "forward") < gather < step["spans"][f"{current} forward"][0]
    result = recorded()
    first = result["runs"]["forward_prefetch"]["steps"][0]
    for _current, following in FORWARD_PAIRS:
        assert inside(first, issued(first, "all_gather", following, "forward"), f"{following} pre-forward")


@on_ranks(WORLD)
def test_rate_limiter_synchronizes_in_unshard_by_default(ranks):
    """limit_all_gathers=True (default): `_unshard` takes a free event to synchronize on every step once two
    frees are queued; with limit_all_gathers=False it never does."""
    assert all(step["waits"] > 0 for step in steps("default", first=0))
    assert all(step["waits"] == 0 for step in steps("no_rate_limit", first=0))


@on_ranks(WORLD)
def test_backward_pre_is_default_and_prefetches_from_pre_backward(ranks):
    """Default backward_prefetch (BACKWARD_PRE): a unit's pre-backward gathers the unit that ran before it in
    forward, before its own gradient computation and reduce-scatter; while it computes, the root (not
    resharded after forward), the unit and the prefetched one are gathered."""
    for step in steps("default", first=0):
        for current, following in BACKWARD_PAIRS:
            gather = issued(step, "all_gather", following, "backward")
            assert inside(step, gather, f"{current} pre-backward")
            if current != "root":
                assert gather < issued(step, "reduce_scatter", current, "backward")
                assert gathered(mark(step, f"{current} pre-backward")) == {"root", current, following}


@on_ranks(WORLD)
def test_root_is_not_resharded_after_forward(ranks):
    """`_post_forward_reshard` frees every unit but the root: after forward only the root is gathered, and it
    is never all-gathered again in backward."""
    for step in steps("default", first=0):
        assert gathered(mark(step, "root post-forward")) == {"root"}
        assert [e["phase"] for e in step["events"] if e["unit"] == "root" and e["op"] == "all_gather"] == ["forward"]


@on_ranks(WORLD)
def test_backward_post_prefetches_after_freeing_current_before_its_reduce_scatter(ranks):
    """BACKWARD_POST: the next all-gather comes from the current unit's post-backward, once its gradient is
    computed and its parameters freed, still before its reduce-scatter; at most one block is gathered."""
    for step in steps("backward_post", first=0):
        for current, following in BACKWARD_PAIRS[1:]:
            gather = issued(step, "all_gather", following, "backward")
            assert inside(step, gather, f"{current} post-backward")
            assert gather < issued(step, "reduce_scatter", current, "backward")
            assert current not in gathered(mark(step, f"{current} post-backward"))
        assert max(len(gathered(m["units"]) - {"root"}) for m in step["marks"] if "backward" in m["at"]) == 1
    for step in steps("default", first=0):
        assert max(len(gathered(m["units"]) - {"root"}) for m in step["marks"] if "backward" in m["at"]) == 2


@on_ranks(WORLD)
def test_without_backward_prefetch_next_allgather_waits_for_current_reduce_scatter(ranks):
    """backward_prefetch=None: a unit is gathered in its own pre-backward, after the reduce-scatter of the
    unit before it in backward: the dependency chain is gradient, reduce-scatter, next all-gather."""
    for step in steps("backward_none", first=0):
        for current, following in BACKWARD_PAIRS[1:]:
            gather = issued(step, "all_gather", following, "backward")
            assert inside(step, gather, f"{following} pre-backward")
            assert gather > issued(step, "reduce_scatter", current, "backward")


@on_ranks(WORLD)
def test_root_rearms_forward_prefetch_flags_only_under_forward_prefetch(ranks):
    """`_root_pre_forward` sets every unit's pre-forward need (and clears `_prefetched`) only when
    forward_prefetch is set; by the end of the root's pre-forward it has prefetched layers.0."""
    for step in steps("forward_prefetch"):
        units = mark(step, "root pre-forward")
        assert all(units[b]["needs_pre_forward"] for b in LAYERS)
        assert [b for b in LAYERS if units[b]["prefetched"]] == ["layers.0"]
    for step in steps("default"):
        assert not any(unit["needs_pre_forward"] for unit in mark(step, "root pre-forward").values())


@on_ranks(WORLD)
def test_post_forward_arms_and_pre_backward_clears_the_pre_backward_need(ranks):
    for step in steps("default", first=0):
        for unit in ["root"] + LAYERS:
            assert mark(step, f"{unit} post-forward")[unit]["needs_pre_backward"]
            assert not mark(step, f"{unit} pre-backward")[unit]["needs_pre_backward"]


@on_ranks(WORLD)
def test_final_callback_clears_a_prefetch_backward_never_used(ranks):
    """UnusedBranch: c's pre-backward prefetches b, whose output never reaches the loss, so b is still
    gathered and `_prefetched` when backward ends; the final callback reshards it and clears the flags."""
    result = recorded()
    for step in result["unused_branch"]:
        before, after = mark(step, "final callback start"), mark(step, "final callback")
        assert before["b"]["gathered"] and before["b"]["prefetched"] and before["b"]["needs_pre_backward"]
        assert not any(any(flags.values()) for flags in after.values())


@on_ranks(WORLD)
def test_mixed_precision_dtypes_of_allgather_reduce_scatter_shards_and_buffers(ranks):
    """MixedPrecision(param_dtype=bf16, reduce_dtype=fp32, buffer_dtype=bf16): all-gathers and compute in
    bf16, reduce-scatters in fp32 of the padded flat size, shards and their gradients fp32, buffers bf16.
    With param_dtype alone, reduce_dtype follows it: bf16 reduce-scatters."""
    result = recorded()
    reduce_dtypes = {"mixed": ("float32", 4), "mixed_param_only": ("bfloat16", 2), "default": ("float32", 4)}
    for config, reduce in reduce_dtypes.items():
        run = result["runs"][config]
        gather = ("bfloat16", 2) if config != "default" else ("float32", 4)
        for step in run["steps"]:
            for e in step["events"]:
                dtype, size = gather if e["op"] == "all_gather" else reduce
                assert (e["dtype"], e["nbytes"]) == (dtype, run["units"][e["unit"]]["padded_numel"] * size)
            assert step["grad_dtypes"] == ["torch.float32"]
        assert {p[3] for p in run["outside_forward"]["parameters"]} == {"torch.float32"}
        assert {p[3] for p in run["in_forward"]["parameters"]} == {f"torch.{gather[0]}"}
    mixed = result["runs"]["mixed"]
    assert mixed["in_forward"]["buffer_dtype"] == mixed["outside_forward"]["buffer_dtype"] == "torch.bfloat16"
    assert result["runs"]["mixed_param_only"]["outside_forward"]["buffer_dtype"] == "torch.float32"


@on_ranks(WORLD)
def test_use_orig_params_exposes_original_names_as_shard_views(ranks):
    """use_orig_params=True: outside forward/backward the optimizer sees the original names, each a 1-D
    Parameter holding this rank's part of the shard, size 0 where the rank holds none; inside forward the
    module sees plain tensors of the original shapes, each aligned inside the flat parameter (padding). The
    default exposes only each unit's flat parameter."""
    by_rank = every_rank(recorded()["runs"]["use_orig_params"])
    names = [p[0] for p in by_rank[0]["outside_forward"]["parameters"]]
    assert "layers.0.attention.qkv.weight" in names and not any("flat_param" in n for n in names)
    for run in by_rank:
        assert all(p[1] == "Parameter" and len(p[2]) == 1 for p in run["outside_forward"]["parameters"])
        assert any(p[2] == [0] for p in run["outside_forward"]["parameters"])
        assert all(p[1] == "Tensor" for p in run["in_forward"]["parameters"])
        assert any(len(p[2]) == 2 for p in run["in_forward"]["parameters"])
    sizes = [{p[0]: p[2][0] for p in run["outside_forward"]["parameters"]} for run in by_rank]
    full = {p[0]: p[2] for p in by_rank[0]["in_forward"]["parameters"]}
    for name, shape in full.items():  # layers.0's parameters: the ranks' parts add up to the original
        numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
        assert sum(part[f"layers.0.{name}"] for part in sizes) == numel
    default = recorded()["runs"]["default"]  # the flat parameters' names and sizes: the same on every rank
    flat_names = ["_flat_param"] + [f"{b}._flat_param" for b in LAYERS]
    assert [p[0] for p in default["outside_forward"]["parameters"]] == flat_names
    for unit, flat in by_rank[0]["units"].items():  # each original aligned inside the flat parameter: padding
        assert flat["numel"] > default["units"][unit]["numel"]


@on_ranks(WORLD)
def test_memory_formula_matches_ddp_and_fsdp1_bytes_per_rank(ranks):
    """The connect-the-dots formula (study.estimates.training_memory) against one Adam step of torch
    DDP and of default FSDP1: DDP holds every byte on each rank; FSDP1 a 1/N shard plus < N elements of
    padding per unit."""
    result = recorded()
    measured = result["memory"]
    ddp = training_memory(measured["params"], world=WORLD, sharded=False)
    fsdp = training_memory(measured["params"], world=WORLD, sharded=True)
    assert measured["ddp"] == {"params": ddp.params, "grads": ddp.grads, "optimizer": ddp.optimizer}
    for part, per_element in (("params", 4), ("grads", 4), ("optimizer", 8)):
        padding = measured["fsdp"][part] - getattr(fsdp, part)
        assert 0 <= padding < measured["units"] * per_element, (part, padding)
    assert fsdp.total * WORLD == ddp.total

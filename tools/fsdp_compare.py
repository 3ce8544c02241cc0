"""Record FSDP1 against FSDP2 on one model: `torchrun --nproc-per-node 4 tools/fsdp_compare.py OUT`.

Run by `tools/record-traces` (which writes reading_notes/traces/fsdp1_vs_fsdp2.json, the FSDP1 ↔ FSDP2 page's
numbers); tests/evidence/test_fsdp1_vs_fsdp2.py runs `record()` on its own ranks and asserts each of the page's
facts on what it returns, and that it equals the committed trace. Everything in it is observed on PyTorch's own
FSDP1 (`FullyShardedDataParallel`, one unit per layer, then the root) and FSDP2 (`fully_shard` on each layer,
then the root) at torch 2.13.0, on WORLD ranks (CPU, gloo), training the small GPT (reference.gpt.model.GPT at
CONFIG: row counts 101, 27, 81 and 108 that 4 does not all divide, so both pad) STEPS Adam steps:
  * layouts: per unit (FSDP1: flat parameter sizes) or per parameter (FSDP2: padded and local rows), and each
    rank's bytes of parameters, gradients and Adam moments after the last step: FSDP1 with its defaults
    (`use_orig_params=False`) and with `use_orig_params=True`, FSDP2 with its defaults;
  * runs: for FSDP1's defaults and each prefetch option (`forward_prefetch`, `backward_prefetch`,
    `limit_all_gathers`, `sharding_strategy=SHARD_GRAD_OP`) and for FSDP2's defaults and each of its options
    (explicit forward and backward prefetch lists, `reshard_after_forward`), per step: the collectives in
    issue order (op, unit, pass, bytes, dtype, group size, whether another unit's hook issued it early, and
    the FSDP hook it was issued in: HookSpans), and FSDP1's rate-limiter waits;
  * state_dicts: what `named_parameters()` and `state_dict()` give under each (FSDP1's FULL_STATE_DICT and
    SHARDED_STATE_DICT, FSDP2's only kind): per key its type, global shape, every rank's local shape, and the
    collectives the call issued.
`record_reference()` runs the reference FSDP1 and FSDP2 on the runs they mirror (REFERENCE_RUNS), for the test.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, FSDPModule, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._flat_param import FlatParameter
from torch.distributed.tensor import DTensor

from reference.distributed import distributed
from reference.fsdp.units import shard_model
from reference.fsdp.wrapper import clean_name
from reference.gpt.model import GPT, SIZES, GPTConfig
from reference.gpt.train import split_batch, synthetic_batches
from reference.measure.fsdp_tracing import unit_scopes
from reference.measure.recorder import CollectiveRecorder
from reference.measure.torch_patches import fsdp1_rate_limiter_wrapped, fsdp1_runtime_wrapped

WORLD = 4
CONFIG = GPTConfig(vocab_size=101, hidden_size=27, num_attention_heads=3, num_layers=2, seq_length=16)
STEPS, BATCH_PER_RANK, SEED, LR = 2, 2, 7, 1e-3
UNITS = ["root", *(f"layers.{i}" for i in range(CONFIG.num_layers))]  # forward order
# run name -> (implementation, options): FSDP1's keyword arguments; FSDP2's fully_shard keyword arguments, plus
# "forward_prefetch" (each unit sets the next: set_modules_to_forward_prefetch) and "backward_prefetch" (the root
# sets every layer, last first: set_modules_to_backward_prefetch)
RUNS = {
    "fsdp1": ("fsdp1", {}),
    "fsdp1_use_orig_params": ("fsdp1", {"use_orig_params": True}),
    "fsdp1_forward_prefetch": ("fsdp1", {"forward_prefetch": True}),
    "fsdp1_backward_post": ("fsdp1", {"backward_prefetch": BackwardPrefetch.BACKWARD_POST}),
    "fsdp1_backward_none": ("fsdp1", {"backward_prefetch": None}),
    "fsdp1_no_limit_all_gathers": ("fsdp1", {"limit_all_gathers": False}),
    "fsdp1_shard_grad_op": ("fsdp1", {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}),
    "fsdp2": ("fsdp2", {}),
    "fsdp2_forward_prefetch": ("fsdp2", {"forward_prefetch": True}),
    "fsdp2_backward_prefetch": ("fsdp2", {"backward_prefetch": True}),
    "fsdp2_reshard_after_forward_false": ("fsdp2", {"reshard_after_forward": False}),
    "fsdp2_reshard_after_forward_2": ("fsdp2", {"reshard_after_forward": 2}),
}
LAYOUTS = ("fsdp1", "fsdp1_use_orig_params", "fsdp2")  # the runs whose bytes per rank the page tables
# The reference's runs where it mirrors torch's (same run names, same options in its own spelling): its FSDP1 as
# use_orig_params=True (reference.fsdp.wrapper), its FSDP2 (reference.fsdp2). Not in the trace: the test compares them.
REFERENCE_RUNS = {
    "fsdp1_use_orig_params": ("reference", {}),
    "fsdp1_forward_prefetch": ("reference", {"forward_prefetch": True}),
    "fsdp1_backward_post": ("reference", {"backward_prefetch": "BACKWARD_POST"}),
    "fsdp1_backward_none": ("reference", {"backward_prefetch": None}),
    **{name: ("reference-fsdp2", options) for name, (impl, options) in RUNS.items() if impl == "fsdp2"},
}


def build(implementation: str, options: dict) -> nn.Module:
    """The GPT at CONFIG, seeded, sharded one unit per layer and then the root by torch's FSDP1, or by
    reference.fsdp.units.shard_model (torch's FSDP2, the reference's FSDP1 and FSDP2)."""
    model = GPT(CONFIG, SEED)
    if implementation == "reference":
        return shard_model(model, implementation, dist.group.WORLD, **{"backward_prefetch": "BACKWARD_PRE", **options})
    if implementation == "fsdp1":
        cpu = torch.device("cpu")  # FSDP1 refuses a CPU module without device_id
        for index, layer in enumerate(model.layers):
            model.layers[index] = FSDP(layer, device_id=cpu, **options)
        return FSDP(model, device_id=cpu, **options)
    options = dict(options)
    backward = options.pop("backward_prefetch", False)
    model = shard_model(model, implementation, dist.group.WORLD, **options)  # forward_prefetch: each the next
    if backward:
        model.set_modules_to_backward_prefetch(list(reversed(model.layers)))
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (a DTensor's local tensor): what a rank allocates for them,
    padding included."""
    storages = {}
    for t in tensors:
        s = local(t).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes after a step: parameters and gradients as allocated (storages), Adam's two moments."""
    params = list(model.parameters())
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": sum(
            local(s[k]).numel() * local(s[k]).element_size()
            for s in optimizer.state.values()
            for k in ("exp_avg", "exp_avg_sq")
        ),
    }


def layout(model: nn.Module, implementation: str) -> dict:
    """FSDP1: each unit's flat parameter (unpadded, padded and shard elements). FSDP2: each parameter's unit and
    shape, its padded shard (every rank the same) and this rank's own rows (shape and elements)."""
    if implementation == "fsdp1":
        return {
            clean_name(name) or "root": {
                "numel": unit._handle.flat_param._unpadded_unsharded_size.numel(),
                "padded_numel": unit._handle.flat_param._padded_unsharded_size.numel(),
                "shard_numel": unit._handle.flat_param._sharded_size.numel(),
                "params": len(unit._handle.flat_param._fqns),
            }
            for name, unit in model.named_modules()
            if isinstance(unit, FSDP) and unit._handle is not None
        }
    padded = {
        id(fp.sharded_param): list(fp.padded_sharded_param_size)
        for module in model.modules()
        if hasattr(module, "_get_fsdp_state")
        for group in module._get_fsdp_state()._fsdp_param_groups
        for fp in group.fsdp_params
    }
    return {
        name: {
            "unit": unit_of(name),
            "shape": list(p.shape),
            "padded_shard": padded[id(p)],
            "padded_shard_numel": math.prod(padded[id(p)]),
            "local": list(local(p).shape),
            "local_numel": local(p).numel(),
        }
        for name, p in model.named_parameters()
    }


class HookSpans:
    """When each unit's FSDP hooks ran: "<unit> pre-forward", "<unit> pre-backward" and "<unit> post-backward", as
    (name, start, end) on the recorder's clock (time.perf_counter), so that each collective can be put in the hook
    that issued it (`issued_in`). FSDP1: around the unit's call up to its wrapped module's forward, and its
    runtime's `_pre_backward_hook` / `_post_backward_hook`; FSDP2: around fully_shard's forward pre-hook (a hook
    before it and one after), each state's `_pre_backward` (looked up when forward registers it) and each
    group's `post_backward` (looked up when backward calls it)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []

    def timed(self, name: str, call, *args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.spans.append((name, start, time.perf_counter()))

    def issued_in(self, at: float) -> str | None:
        """The innermost hook running at `at` (the latest-starting span around it), or None."""
        around = [(start, name) for name, start, end in self.spans if start <= at <= end]
        return max(around)[1] if around else None

    @contextlib.contextmanager
    def installed(self, model: nn.Module, implementation: str):
        """Time `model`'s hooks while inside (torch's FSDP1 or FSDP2; nothing for the reference's). Enter it inside
        unit_scopes: FSDP2's post-backward is wrapped on each group, around unit_scopes's own wrapping."""
        with contextlib.ExitStack() as stack:
            pairs = []  # (module whose call starts the pre-forward, module whose forward ends it, unit)
            if implementation == "fsdp1":
                units = {clean_name(n) or "root": u for n, u in model.named_modules() if isinstance(u, FSDP)}
                names = {id(u._handle): n for n, u in units.items()}
                pairs = [(u, u._fsdp_wrapped_module, n) for n, u in units.items()]
                stack.enter_context(
                    fsdp1_runtime_wrapped(
                        _pre_backward_hook=lambda original, state, module, handle, *a: self.timed(
                            f"{names.get(id(handle))} pre-backward", original, state, module, handle, *a
                        ),
                        _post_backward_hook=lambda original, state, handle, *a: self.timed(
                            f"{names.get(id(handle))} post-backward", original, state, handle, *a
                        ),
                    )
                )
            elif implementation == "fsdp2":
                for name, module in model.named_modules():
                    if isinstance(module, FSDPModule):
                        name = name or "root"
                        state = module._get_fsdp_state()
                        (group,) = state._fsdp_param_groups
                        for owner, method in ((state, "_pre_backward"), (group, "post_backward")):
                            timed = functools.partial(self.timed, f"{name} {method.strip('_').replace('_', '-')}")
                            setattr(owner, method, functools.partial(timed, getattr(owner, method)))
                            stack.callback(delattr, owner, method)
                        pairs.append((module, module, name))
            for outer, inner, name in pairs:
                started = {}

                def before(_module, _args, started=started):
                    started["t"] = time.perf_counter()

                def after(_module, _args, name=name, started=started):
                    self.spans.append((f"{name} pre-forward", started["t"], time.perf_counter()))

                stack.callback(outer.register_forward_pre_hook(before, prepend=True).remove)
                stack.callback(inner.register_forward_pre_hook(after).remove)
            yield self


def collectives(recorder: CollectiveRecorder, prefetches, hooks: HookSpans) -> list[dict]:
    """The step's collectives in issue order: op, unit, pass, bytes, dtype, group size, whether another unit's
    hook issued it early (FSDP's prefetch), and the hook it was issued in."""
    return [
        {
            "op": e.op,
            "unit": e.module,
            "phase": e.phase,
            "nbytes": e.nbytes,
            "dtype": e.dtype,
            "ranks": len(e.group_ranks),
            "prefetch": early,
            "issued_in": hooks.issued_in(e.start),
        }
        for e, early in zip(recorder.events, prefetches.flags(recorder))
    ]


def train(name: str, recorder: CollectiveRecorder, runs: dict = RUNS) -> tuple[nn.Module, dict]:
    """Run `runs[name]` STEPS steps; the model and this rank's record of it."""
    implementation, options = runs[name]
    model = build(implementation, options)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    waits = [0]

    def dequeue_if_needed(original, queue):
        event = original(queue)
        waits[0] += event is not None
        return event

    steps, hooks = [], HookSpans()
    limiter = fsdp1_rate_limiter_wrapped(dequeue_if_needed) if implementation == "fsdp1" else contextlib.nullcontext()
    with limiter, unit_scopes(model) as prefetches, hooks.installed(model, implementation):
        for tokens in synthetic_batches(CONFIG, STEPS, BATCH_PER_RANK * world, SEED):
            recorder.clear()
            hooks.spans.clear()
            waits[0] = 0
            ((inputs, labels),) = split_batch(tokens, world, rank, 1)
            loss = model(inputs, labels)
            loss.backward()
            optimizer.step()
            steps.append(
                {
                    "loss": round(loss.item(), 6),
                    "collectives": collectives(recorder, prefetches, hooks),
                    "limiter_waits": waits[0],
                }
            )
            if len(steps) < STEPS:
                optimizer.zero_grad()
    record = {"steps": steps}
    if name in LAYOUTS and implementation in ("fsdp1", "fsdp2"):
        record["layout"] = layout(model, implementation)
    if name in LAYOUTS:
        record["held"] = held_bytes(model, optimizer)
    return model, record


def describe(recorder: CollectiveRecorder, call) -> dict:
    """`call()`'s entries (a state_dict's items or named_parameters) by key: type (FlatParameter for what
    `isinstance` says is one: FSDP1 builds it as an nn.Parameter with the flat parameter's attributes), global
    shape, this rank's local shape (a ShardedTensor's local shard, a DTensor's local tensor, else the tensor's
    own), placement; and the collectives the call issued."""
    recorder.clear()
    entries = call()
    out = {}
    for key, value in entries:
        kind = "FlatParameter" if isinstance(value, FlatParameter) else type(value).__name__
        entry = {"type": kind, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
        if isinstance(value, DTensor):
            entry.update(local=list(value.to_local().shape), placement=[str(p) for p in value.placements])
        elif hasattr(value, "local_shards"):
            shards = value.local_shards()
            entry.update(
                local=list(shards[0].tensor.shape) if shards else [0],
                placement=[f"{type(value.sharding_spec()).__name__}(dim={value.sharding_spec().dim})"],
            )
        else:
            entry["local"] = list(value.shape)
        out[clean_name(key)] = entry
    return {"entries": out, "collectives": [{"op": e.op, "nbytes": e.nbytes} for e in recorder.events]}


def state_dicts(models: dict[str, nn.Module], recorder: CollectiveRecorder) -> dict:
    """What each run's model exposes, after training: its parameters and its state_dict (FSDP1: full and
    sharded)."""
    fsdp1, orig, fsdp2 = models["fsdp1"], models["fsdp1_use_orig_params"], models["fsdp2"]

    def sharded_state_dict():
        with FSDP.state_dict_type(fsdp1, StateDictType.SHARDED_STATE_DICT):
            return fsdp1.state_dict().items()

    with warnings.catch_warnings():  # FSDP1's state_dict_type and ShardedTensor announce their deprecation
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        return {
            "fsdp1_parameters": describe(recorder, fsdp1.named_parameters),
            "fsdp1_use_orig_params_parameters": describe(recorder, orig.named_parameters),
            "fsdp1_full_state_dict": describe(recorder, lambda: fsdp1.state_dict().items()),
            "fsdp1_sharded_state_dict": describe(recorder, sharded_state_dict),
            "fsdp2_parameters": describe(recorder, fsdp2.named_parameters),
            "fsdp2_state_dict": describe(recorder, lambda: fsdp2.state_dict().items()),
        }


def merge_ranks(per_rank: list[dict]) -> dict:
    """Rank 0's record, with what differs by rank (losses, layouts' local rows, held bytes, state_dict local
    shapes) as one list per field, rank by rank."""
    merged = json.loads(json.dumps(per_rank[0]))
    for name, run in merged["runs"].items():
        for index, step in enumerate(run["steps"]):
            step["loss"] = [r["runs"][name]["steps"][index]["loss"] for r in per_rank]
        if "held" in run:
            run["held"] = [r["runs"][name]["held"] for r in per_rank]
        if name == "fsdp2":
            for param, entry in run["layout"].items():
                for key in ("local", "local_numel"):
                    entry[key] = [r["runs"][name]["layout"][param][key] for r in per_rank]
    for view, described in merged["state_dicts"].items():
        for key, entry in described["entries"].items():
            entry["local"] = [r["state_dicts"][view]["entries"][key]["local"] for r in per_rank]
    return merged


def unit_of(name: str) -> str:
    """The unit a parameter of the unsharded GPT goes to: its layer's, else the root's."""
    return next((unit for unit in UNITS[1:] if name.startswith(f"{unit}.")), "root")


def record() -> dict:
    """Every run and state_dict on this rank, merged with the other ranks' (the same on every rank)."""
    models, runs = {}, {}
    with CollectiveRecorder() as recorder:
        for name in RUNS:
            models[name], runs[name] = train(name, recorder)
        described = state_dicts(models, recorder)
    mine = {"runs": runs, "state_dicts": described}
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    return {
        "kind": "fsdp_compare",
        "world": dist.get_world_size(),
        "config": {name: getattr(CONFIG, name) for name in SIZES},
        "steps": STEPS,
        "batch_per_rank": BATCH_PER_RANK,
        "dtype": "float32",
        "dtype_size": 4,
        "units": UNITS,
        "parameters": [
            {"name": n, "shape": list(p.shape), "numel": p.numel(), "unit": unit_of(n)}
            for n, p in GPT(CONFIG, SEED).named_parameters()
        ],
        "options": {name: {k: str(v) for k, v in options.items()} for name, (_, options) in RUNS.items()},
        **merge_ranks(per_rank),
    }


def record_reference() -> dict:
    """The reference's REFERENCE_RUNS on this rank (the same fields as `record()`'s runs, this rank's own)."""
    with CollectiveRecorder() as recorder:
        return {name: train(name, recorder, REFERENCE_RUNS)[1] for name in REFERENCE_RUNS}


def trace_of(recorded: dict) -> dict:
    """What the committed trace keeps of `record()`: all but the losses (the same run on another CPU may round
    them otherwise; the test compares them live)."""
    trace = json.loads(json.dumps(recorded))
    for run in trace["runs"].values():
        for step in run["steps"]:
            del step["loss"]
    return trace


def main(out: Path) -> None:
    with distributed("cpu", timeout_s=120):
        trace = record()
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "fsdp1_vs_fsdp2.json").write_text(json.dumps(trace_of(trace), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

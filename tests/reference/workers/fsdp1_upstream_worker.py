"""Worker for tests/reference/test_fsdp1_upstream_claims.py: `torchrun --nproc-per-node 2 ... OUTDIR`.

Runs PyTorch FSDP1 itself (torch.distributed.fsdp.FullyShardedDataParallel, one unit per layer of the test
GPT, reference.gpt.model.UnshardedGPT, then the root) on CPU/gloo with its defaults and with each option the
FSDP close reading discusses, three training steps per configuration, under one `CollectiveRecorder`. The only
option every configuration sets is `device_id=cpu`: FSDP1 refuses a CPU module without it. Each rank writes
OUTDIR/rank{r}.json with, per configuration and step:
  events  every all-gather and reduce-scatter (op, unit, phase, bytes, dtype, issue time), attributed to the
          unit whose flat parameter it moves (reference.measure.fsdp_tracing.torch_fsdp1_unit_scopes);
  spans   "<unit> pre-forward" (the FSDP module's call up to its wrapped module's forward: FSDP1's root and
          unit pre-forward), "<unit> forward" (the wrapped module's forward), "<unit> post-forward",
          "<unit> pre-backward" and "<unit> post-backward" (FSDP1's `_pre_backward_hook` / `_post_backward_hook`
          calls that run), "final callback" (`_post_backward_final_callback`);
  marks   at the end of each span (and the start of the final callback), every unit's `_prefetched`,
          `_needs_pre_forward_unshard`, `_needs_pre_backward_unshard` and whether its unsharded flat parameter
          is allocated ("gathered");
  waits   how many times `_unshard`'s rate limiter took a free event to synchronize.
Per configuration it also writes what the note says about parameters and dtypes, and per-rank bytes of
parameters, gradients and Adam states under DDP and FSDP1 for the memory formulas.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
import torch.distributed as dist
from common import serve
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from reference.fsdp.wrapper import clean_name
from reference.gpt.model import GPTConfig, UnshardedGPT
from reference.gpt.train import split_batch, synthetic_batches
from reference.measure.fsdp_tracing import torch_fsdp1_unit_scopes
from reference.measure.recorder import CollectiveRecorder, current_phase
from reference.torch_patches import fsdp1_rate_limiter_wrapped, fsdp1_runtime_wrapped

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
    """Spans of FSDP1's hooks and the units' flags at their ends, for one model (see the module docstring)."""

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


def results(device: torch.device) -> dict:
    """Every configuration's recorded steps, the unused-branch run and the memory figures (CPU)."""
    assert device.type == "cpu", "FSDP1 runs here with device_id=cpu"
    rank, world = dist.get_rank(), dist.get_world_size()
    initial = UnshardedGPT(CONFIG, SEED)
    result: dict = {"rank": rank, "world": world, "runs": {}}
    with CollectiveRecorder() as recorder:
        for name, options in CONFIGS.items():
            result["runs"][name] = run_config(options, initial, recorder, rank, world)
        result["unused_branch"] = unused_branch(recorder)
    result["memory"] = memory(initial, rank, world)
    return result


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()

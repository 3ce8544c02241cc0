"""Record the runs the study site's diagrams and numbers come from: `torchrun --nproc-per-node 2 tools/trace_worker.py
OUT`
and `torchrun --nproc-per-node 4 tools/trace_worker.py OUT pipeline`.

Run by `tools/record-traces` (which writes reading_notes/traces/); rank 0 writes OUT/tp_block.json,
OUT/tp_block_llama.json, OUT/fsdp_forward.json and OUT/fsdp2_forward.json (2 ranks), or OUT/pipeline_gpipe.json,
OUT/pipeline_1f1b.json, OUT/pipeline_interleaved.json, OUT/pipeline_zb_h1.json, OUT/pipeline_zbv.json and
OUT/pipeline_dualpipev.json (4 ranks, `pipeline`).
Everything in them is observed, not computed:
  * tp_block: one tensor-parallel transformer block (reference.tensor_parallel) at two hidden sizes. The
    CollectiveRecorder's events (op, module, phase, shape, bytes) of one forward+backward; the forward order of
    the block's leaf modules and of the aten ops run between them (attention, GELU), from module hooks and a
    dispatch mode; the forward FLOPs per rank from torch's FlopCounterMode.
  * tp_block_llama: the same for the Llama/Qwen2 block (reference.tensor_parallel.transformer.LlamaBlock,
    GPTConfig(style="llama") with TP_KV_HEADS key/value heads: one per rank), as the one layer of a middle
    pipeline stage, which hands it the rotary positions.
  * fsdp_forward: the reference FSDP on the small GPT (reference.gpt.model.GPT, one unit per layer
    plus the root, forward and backward prefetch) in its second step, when forward prefetch knows the unit
    order: collectives and per-unit compute spans, each stamped with the FLOPs computed so far in the step (the
    recorder counts them; attention on the math backend, which has a FLOP formula), the units' flat sizes, and
    the forward FLOPs per token of the unsharded model.
  * fsdp2_forward: the same step under the reference FSDP2 (reference.fsdp2: fully_shard on each layer, then
    the root; each group set to prefetch the next in forward), its units the parameter groups.
  * pipeline_gpipe / pipeline_1f1b: one training step (reference.gpt.train.train_step) of the small GPT on 4
    pipeline stages (tp 1, dp 1) with PIPELINE_M micro-batches, per stage: the action order with each action's
    start, end and FLOPs (attention on the CPU flash kernel, which torch has no FLOP formula for, counts 0),
    the peak of micro-batches in flight (as the schedule counts them and as autograd keeps
    them), the peak activation bytes, and every point-to-point send and receive the recorder saw.
  * pipeline_interleaved: the same for interleaved 1F1B, INTERLEAVED_V model chunks per stage, on the same
    GPT: a 1F1B stage holds two layers, an interleaved chunk one, so the notes compare equal work.
  * pipeline_zb_h1 / pipeline_zbv / pipeline_dualpipev: the same for the zero-bubble schedules
    (reference.pipeline.zero_bubble), on the same GPT: ZB-H1 two layers a stage, ZB-V and DualPipeV two
    one-layer stages per rank in a V (`v_shape`); their backwards split into I and W actions (DualPipeV also
    runs whole B's), and each stage's peak of bytes its I's left waiting for their W's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from reference.distributed import distributed
from reference.fsdp.units import shard_model
from reference.fsdp2.state import STATE_ATTR
from reference.gpt.model import GPT, GPTConfig
from reference.gpt.parallelize import build_chunks, parallelize_gpt
from reference.gpt.train import data_parallel, split_batch, train_step
from reference.gpt.train import synthetic_batches as gpt_batches
from reference.measure.fsdp_tracing import unit_scopes
from reference.measure.pipeline_meter import PipelineMeter
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.pipeline.zero_bubble import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from study.traces import EVENT_KEYS, PIPELINE_STAGE_KEYS, SPAN_KEYS  # what the site's trace comparison reads

TP_SHAPE = dict(s=8, b=2, heads=4)
TP_HIDDEN = (64, 128)  # two sizes: bytes grow like h, FLOPs like a*h^2 + c*h
TP_KV_HEADS = {"gpt2": TP_SHAPE["heads"], "llama": 2}  # llama: grouped-query, one key/value head per TP rank
FSDP_CONFIG = GPTConfig(vocab_size=128, hidden_size=32, num_attention_heads=4, num_layers=2, seq_length=16)
FSDP_BATCH, SEED = 4, 1234
PIPELINE_RANKS, PIPELINE_M, PIPELINE_B = 4, 8, 2  # pp 4, 8 micro-batches of 2 sequences
INTERLEAVED_V = 2
# one model for every schedule, so the timelines set side by side do the same work: p * v layers
PIPELINE_CONFIG = GPTConfig(
    vocab_size=51, hidden_size=16, num_attention_heads=4, num_layers=PIPELINE_RANKS * INTERLEAVED_V, seq_length=8
)
P2P_OPS = ("send", "recv")


def counted_flops(step) -> int:
    """FLOPs of `step()` as FlopCounterMode counts them. Attention runs on the math backend here: torch 2.13
    has no FLOP formula for the CPU flash-attention kernel, and would count its matmuls as zero."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as flops:
        step()
    return flops.get_total_flops()


class ForwardSteps(TorchDispatchMode):
    """The forward as a list of steps: each leaf module run, and the aten ops run directly in a parent."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.steps: list[dict] = []
        self.stack: list[tuple[str, torch.nn.Module]] = []
        for name, module in model.named_modules():
            module.register_forward_pre_hook(lambda m, a, name=name: self._enter(name, m))
            module.register_forward_hook(lambda m, a, o: self._leave())

    def _enter(self, name: str, module: torch.nn.Module) -> None:
        self.stack.append((name, module))
        if not list(module.children()):
            weight = getattr(module, "weight", None)
            self.steps.append(
                {
                    "module": name,
                    "type": type(module).__name__,
                    "weight_shape": list(weight.shape) if weight is not None else None,
                }
            )

    def _leave(self) -> None:
        self.stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.stack and list(self.stack[-1][1].children()):
            parent, op = self.stack[-1][0], func.overloadpacket.__name__
            if not self.steps or self.steps[-1].get("in") != parent:
                self.steps.append({"in": parent, "ops": []})
            self.steps[-1]["ops"].append(op)
        return func(*args, **(kwargs or {}))


def tp_block_model(style: str, h: int, tp_group) -> tuple[torch.nn.Module, object]:
    """One block of `style` as `layers.0` of a middle pipeline stage (no embedding, no head) of the GPT, and its
    forward from a [s, b, h] activation (which passes a llama block its rotary positions)."""
    config = GPTConfig(
        hidden_size=h,
        num_attention_heads=TP_SHAPE["heads"],
        num_kv_heads=TP_KV_HEADS[style] if style == "llama" else None,
        num_layers=3,
        seq_length=TP_SHAPE["s"],
        style=style,
    )
    stage = parallelize_gpt(GPT(config, SEED, layers=(1, 2)), tp_group, seed=SEED)
    return stage, lambda x: stage(None, None, hidden=x)


def tp_block(world: int, style: str = "gpt2") -> dict:
    layout = build_layout(world)
    s, b = TP_SHAPE["s"], TP_SHAPE["b"]
    runs = []
    for h in TP_HIDDEN:
        torch.manual_seed(SEED)
        model, forward = tp_block_model(style, h, layout.tp_group)
        x = torch.randn(s, b, h)
        flops = counted_flops(lambda forward=forward, x=x: forward(x).pow(2).mean().backward())  # forward + backward
        model.zero_grad(set_to_none=True)
        steps = ForwardSteps(model)
        recorder = CollectiveRecorder()
        recorder.watch(model)
        with recorder, steps:
            forward(x).pow(2).mean().backward()
        events = [{k: e[k] for k in EVENT_KEYS} for e in recorder.to_dict()["events"]]
        runs.append({"h": h, "step_flops_per_rank": flops, "events": events, "forward_steps": steps.steps})
    return {
        "kind": "tp_block",
        "world": world,
        "tp": layout.tp_size,
        **TP_SHAPE,  # s, b, heads
        "style": style,
        "kv_heads": TP_KV_HEADS[style],
        "dtype": "float32",
        "dtype_size": 4,
        "runs": runs,
    }


def fsdp_forward(world: int, implementation: str = "reference") -> dict:
    """The fsdp_forward trace of `implementation`: "reference" (FSDP1's flat parameters) or "reference-fsdp2"
    (per-parameter fully_shard, its units the parameter groups, forward prefetch set explicitly)."""
    rank = dist.get_rank()
    model = GPT(FSDP_CONFIG, SEED)
    params = sum(p.numel() for p in model.parameters())
    tokens = gpt_batches(FSDP_CONFIG, 1, FSDP_BATCH, SEED)[0]
    with torch.no_grad():
        flops = counted_flops(lambda: model(tokens[:, :-1], tokens[:, 1:]))
    model = shard_model(
        model, implementation, dist.group.WORLD, backward_prefetch="BACKWARD_PRE", forward_prefetch=True
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    recorder = CollectiveRecorder()
    with sdpa_kernel(SDPBackend.MATH), recorder, unit_scopes(model):  # math attention: its FLOPs are counted
        for batch in gpt_batches(FSDP_CONFIG, 2, FSDP_BATCH, SEED):
            recorder.clear()  # keep the second step: the first records the unit order, so it cannot prefetch
            ((inputs, labels),) = split_batch(batch, world, rank, 1)
            model(inputs, labels).backward()
            optimizer.step()
            optimizer.zero_grad()
    record = recorder.to_dict()
    return {
        "kind": "fsdp_forward",
        "world": world,
        "forward_prefetch": True,
        "backward_prefetch": "BACKWARD_PRE",
        "params": params,
        "dtype": "float32",
        "dtype_size": 4,
        "tokens_per_rank": FSDP_BATCH * FSDP_CONFIG.seq_length // world,
        "s": FSDP_CONFIG.seq_length,  # a rank's block shape: calibrated rates are looked up by it
        "b": FSDP_BATCH // world,
        "h": FSDP_CONFIG.hidden_size,
        "forward_flops_per_token": flops / (FSDP_BATCH * FSDP_CONFIG.seq_length),
        "units": fsdp_units(model, world),
        "events": [{**{k: e[k] for k in EVENT_KEYS}, "flops": e["flops"], **_times(e)} for e in record["events"]],
        "spans": [{**{k: s[k] for k in SPAN_KEYS}, **_times(s)} for s in record["spans"]],
    }


def fsdp_units(model: torch.nn.Module, world: int) -> list[dict]:
    """Each unit in forward order (the root first): its parameters' elements and what its all-gather moves
    (FSDP1: the padded flat parameter; FSDP2: N padded row shards of each parameter)."""
    if hasattr(model, "handles"):
        return [{"name": h.name, "param_numel": h.param_numel, "padded_numel": h.padded_numel} for h in model.handles()]
    groups = [m.__dict__[STATE_ATTR].group for m in model.modules() if STATE_ATTR in m.__dict__]
    return [
        {
            "name": group.name or "root",
            "param_numel": sum(p.orig_size.numel() for p in group.params),
            "padded_numel": world * sum(p.shard_numel for p in group.params),
        }
        for group in sorted(groups, key=lambda g: (g.name != "", g.name))
    ]


def pipeline(schedule: str, virtual_stages: int = 1) -> dict:
    """One train_step on PIPELINE_RANKS stages (v model chunks each: interleaved; two in a V: zbv, dualpipev);
    every stage's record, gathered on rank 0."""
    layout = build_layout(1, PIPELINE_RANKS, 1)
    chunks = build_chunks(PIPELINE_CONFIG, layout, virtual_stages, schedule=schedule, seed=SEED)
    wrapped = [data_parallel(chunk, layout) for chunk in chunks]
    model = wrapped if len(wrapped) > 1 else wrapped[0]
    optimizer = torch.optim.SGD([p for chunk in wrapped for p in chunk.parameters()], lr=0.1)
    tokens = gpt_batches(PIPELINE_CONFIG, 1, PIPELINE_M * PIPELINE_B, SEED)[0]
    recorder, result = CollectiveRecorder(), PipelineMeter()
    train_step(
        model,
        optimizer,
        tokens,
        layout,
        num_micro_batches=PIPELINE_M,
        schedule=schedule,
        record=recorder,
        observer=result,
    )
    p2p = [{k: e[k] for k in EVENT_KEYS} for e in recorder.to_dict()["events"] if e["op"] in P2P_OPS]
    mine = {
        **{key: getattr(result, key) for key in PIPELINE_STAGE_KEYS},
        "action_spans": [
            [round(a - result.start_s, 6), round(b - result.start_s, 6)] for a, b in result.action_spans
        ],  # seconds from the schedule's start
        "busy_s": round(result.busy_s, 6),
        "total_s": round(result.total_s, 6),
        "p2p": p2p,
    }
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, mine)
    c = PIPELINE_CONFIG
    return {
        "kind": "pipeline",
        "schedule": schedule,
        "virtual_stages": len(chunks),
        "v_shape": schedule in V_SCHEDULES,
        "world": dist.get_world_size(),
        "pp": layout.pp_size,
        "m": PIPELINE_M,
        "b": PIPELINE_B,
        "s": c.seq_length,
        "h": c.hidden_size,
        "layers": c.num_layers,
        "dtype": "float32",
        "dtype_size": 4,
        "activation_shape": list(chunks[0].activation_shape(PIPELINE_B)),
        "stages": sorted(stages, key=lambda st: st["pp_rank"]),
    }


def _times(record: dict) -> dict:
    """Start/end in seconds from the step's first record, to the microsecond (only their order is used)."""
    return {k: None if record[k] is None else round(record[k], 6) for k in ("start", "end")}


def main(out: Path, what: str = "tp_fsdp") -> None:
    with distributed("cpu", timeout_s=60):
        world = dist.get_world_size()
        if what == "pipeline":
            traces = {f"pipeline_{schedule}": pipeline(schedule) for schedule in ("gpipe", "1f1b")}
            traces["pipeline_interleaved"] = pipeline("1f1b", INTERLEAVED_V)
            for schedule in ZERO_BUBBLE_SCHEDULES:
                traces[f"pipeline_{schedule.replace('-', '_')}"] = pipeline(schedule)
        else:
            traces = {
                "tp_block": tp_block(world),
                "tp_block_llama": tp_block(world, "llama"),
                "fsdp_forward": fsdp_forward(world),
                "fsdp2_forward": fsdp_forward(world, "reference-fsdp2"),
            }
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            for name, trace in traces.items():
                (out / f"{name}.json").write_text(json.dumps(trace, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:3])

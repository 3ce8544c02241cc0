"""`torchrun --nproc-per-node 2 -m reference.hf_tp [--sequence-parallel] [--num-layers L] ...`: one forward and
backward of Hugging Face's Qwen2ForCausalLM under PyTorch DTensor's tensor-parallel plan.

Builds a tiny Qwen2 from a config with random weights (no download), applies the Tensor Parallelism Knowledge
Compilation's plan (reference/hf_tp/plan.py) with `parallelize_module` over every rank, and prints from rank 0:
the plan (module -> style), each parameter's placement and local shape, the collectives `CommDebugMode` counted
per decoder layer, elsewhere and per step (with bytes, reference.measure.comm_bytes), and the loss beside the
unsharded model's on the same weights and batch. `--json` prints the same as one object, which
tools/record-traces keeps for the walkthrough's worked example.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import inspect
import json
import os
import re
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from reference.arguments import OneLineParser, add_device_argument, add_flag, size
from reference.distributed import LaunchError, distributed, one_line_errors
from reference.measure.comm_bytes import CommBytes
from reference.parallel_state import ParallelConfigError

PACKAGE = "reference.hf_tp"
PROG = f"torchrun --nproc-per-node N -m {PACKAGE}"
MAX_LAYERS = 64  # a CPU step of a 64-layer tiny model takes seconds; more only waits longer
MAX_BATCH = 64
MAX_SEQ = 128  # plan.tiny_config's max_position_embeddings: rotary tables end there
GRAD_TOLERANCE = 1e-5  # fp32 sums in another order: observed <= 5e-8 (tests/evidence/test_qwen2_dtensor.py)
PLAIN = "plain"  # a parameter the plan left an ordinary tensor: whole on every rank
# What torch warns, once per rank, about the global full backward pre-hook CommDebugMode's module tracker sets:
# HF's Qwen2Model and Qwen2ForCausalLM return ModelOutput objects, not tensors, and neither the embedding (token
# ids) nor attention (called by keyword) has a positional input that needs a gradient.
HOOK_WARNINGS = ("For backward hooks to be called", "Full backward hook is firing")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="One forward and backward of Hugging Face's Qwen2ForCausalLM (tiny, random weights, no "
        "download) under PyTorch DTensor's tensor-parallel plan over all ranks (1 or 2: the model has 2 key/value "
        "heads), printing the plan, each parameter's placement and local shape on rank 0, the collectives "
        "CommDebugMode counted per decoder layer and per step with their bytes, and the loss beside the "
        "unsharded model's.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--num-layers", type=size(MAX_LAYERS, "a tiny model; more only runs longer"), default=2, help="decoder layers L"
    )
    add_flag(
        parser,
        "--micro-batch-size",
        "--batch-size",
        dest="batch_size",
        type=size(MAX_BATCH, "a tiny model; more only runs longer"),
        default=4,
        help="sequences b in the batch",
    )
    parser.add_argument(
        "--seq-length",
        type=size(MAX_SEQ, "the model's max_position_embeddings"),
        default=8,
        help="tokens per sequence s",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="the plan with sequence parallelism: norms SequenceParallel, activations between layers split "
        "along the sequence (s must be a multiple of the ranks, or --pad-sequence)",
    )
    parser.add_argument(
        "--pad-sequence",
        action="store_true",
        help="pad a sequence the ranks do not divide to the next multiple (the pad's labels ignored, positions "
        "continued): the Knowledge Compilation's fix; the unsharded model still runs the unpadded batch",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights; the batch's is seed + 1")
    add_device_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object instead of text")
    return parser


def load_plan():
    """reference.hf_tp.plan, or a LaunchError saying how to install transformers, which it imports."""
    try:
        return importlib.import_module("reference.hf_tp.plan")
    except ModuleNotFoundError as error:
        if error.name != "transformers":
            raise
        raise LaunchError(
            "needs Hugging Face transformers, which is not installed: `make setup` installs it with the test "
            "extras (or: .venv/bin/python -m pip install transformers)"
        ) from None


def check_sizes(config, args, world: int) -> None:
    """Refuse, before any process group exists, what the plan cannot split evenly over `world` ranks."""
    for heads, what in ((config.num_key_value_heads, "key/value"), (config.num_attention_heads, "query")):
        if heads % world:
            raise ParallelConfigError(
                f"{world} ranks cannot split the model's {heads} {what} heads: ColwiseParallel would give a rank "
                f"part of a head, and HF's attention reshapes whole heads; launch 1 or 2 ranks"
            )
    if args.sequence_parallel and args.seq_length % world and not args.pad_sequence:
        shards = sorted({len(c) for c in torch.arange(args.seq_length).chunk(world)}, reverse=True)
        raise ParallelConfigError(
            f"sequence length {args.seq_length} is not divisible by the {world} ranks: SequenceParallel takes "
            f"each rank's {' or '.join(map(str, shards))} tokens as an even shard, unchecked, and the next "
            f"all-gather's sizes disagree (gloo aborts the job); pass --pad-sequence to pad it to "
            f"{args.seq_length + (-args.seq_length) % world}, or use a multiple of {world}"
        )


def placement_text(placement) -> str:
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    return str(placement)


def layout_text(value) -> str:
    if isinstance(value, tuple):
        return "(" + "".join(f"{layout_text(v)}, " for v in value).rstrip(" ") + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {layout_text(v)}" for k, v in value.items()) + "}"
    return placement_text(value) if hasattr(value, "is_shard") else repr(value)


def style_text(style) -> str:
    """A parallel style as the plan spells it: its class and the constructor arguments that differ from the
    defaults."""
    default, arguments, shown = vars(type(style)()), inspect.signature(type(style)).parameters, []
    for name, value in vars(style).items():
        if name in arguments and value != default[name]:
            if isinstance(value, tuple) and len(value) == 1 and isinstance(default[name], tuple):
                value = value[0]  # ColwiseParallel(input_layouts=Replicate()) keeps (Replicate(),)
            shown.append(f"{name}={layout_text(value)}")
    return f"{type(style).__name__}({', '.join(shown)})"


def plan_rows(plan, sequence_parallel: bool) -> list[dict]:
    block = [
        {"module": f"model.layers.*.{m}", "style": style_text(s)} for m, s in plan.block_plan(sequence_parallel).items()
    ]
    return block + [{"module": m, "style": style_text(s)} for m, s in plan.top_plan(sequence_parallel).items()]


def parameter_rows(model: torch.nn.Module) -> list[dict]:
    rows = []
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        placement = ", ".join(map(placement_text, param.placements)) if isinstance(param, DTensor) else PLAIN
        rows.append(
            {"name": name, "placement": placement, "local_shape": list(local.shape), "shape": list(param.shape)}
        )
    return rows


def where(module: str) -> str:
    """The row a collective is shown in: its decoder layer, else the module it came from, else the loss."""
    if module == "Global":
        return "loss_parallel"
    module = module.split(".", 1)[1] if "." in module else ""  # drop the class name CommDebugMode puts first
    layer = re.match(r"model\.layers\.\d+", module)
    return layer.group(0) if layer else module or "Qwen2ForCausalLM"


def collective_rows(comm: CommBytes) -> list[dict]:
    """{where, phase, kind, count, bytes, each} per row and phase, rows in issue order, then the whole step;
    `each` is the bytes of one collective when all of them have the same size, else null."""
    sizes: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    for counted in comm.counted:
        sizes[(where(counted.module), counted.phase, counted.kind)].append(counted.nbytes)
        sizes[("step", counted.phase, counted.kind)].append(counted.nbytes)
    rows = []
    for row in [*dict.fromkeys(w for w, _, _ in sizes if w != "step"), "step"]:
        for phase in ("forward", "backward"):
            for kind in sorted(k for w, p, k in sizes if (w, p) == (row, phase)):
                n = sizes[(row, phase, kind)]
                each = n[0] if len(set(n)) == 1 else None
                rows.append(
                    {"where": row, "phase": phase, "kind": kind, "count": len(n), "bytes": sum(n), "each": each}
                )
    return rows


@contextlib.contextmanager
def counted():
    """`CommBytes` around the step, without the warnings its hooks cause: they are about the measurement, not the
    plan (the counts they might concern are the closed form tests/reference/test_hf_tp_demo.py checks)."""
    with warnings.catch_warnings():
        for message in HOOK_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        with CommBytes() as comm:
            yield comm


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (a Partial one summed: a collective, so outside the counted step)."""
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for name, p in model.named_parameters()
    }


def step(plan, args, device: torch.device, world: int) -> dict:
    """One forward and backward of the planned model, counted, and of the unsharded one: the report."""
    config = plan.tiny_config(num_hidden_layers=args.num_layers)
    generator = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_length), generator=generator).to(device)
    labels, positions = plan.shift_labels(ids), torch.arange(args.seq_length, device=device).unsqueeze(0)
    base = plan.build(config, args.seed).to(device)
    oracle = copy.deepcopy(base)
    oracle_loss = plan.loss_and_backward(oracle, ids, labels, positions)
    if args.pad_sequence and args.seq_length % world:  # pad ids with token 0, labels ignored, positions continued
        ids, labels = plan.pad_to_multiple(ids, world, 0), plan.pad_to_multiple(labels, world, plan.IGNORE_INDEX)
        positions = torch.arange(ids.size(1), device=device).unsqueeze(0)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    model = plan.document_plan(copy.deepcopy(base), mesh, args.sequence_parallel)
    with counted() as comm:
        loss = plan.loss_and_backward(model, ids, labels, positions)
    partial = [
        n for n, p in model.named_parameters() if isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial()
    ]
    grads, oracle_grads = full_grads(model), full_grads(oracle)
    grad_diff = max((grads[n] - oracle_grads[n]).abs().max().item() for n in grads)
    parameters = parameter_rows(model)
    head_dim = config.hidden_size // config.num_attention_heads
    return {
        "kind": "dtensor",
        "world": world,
        "device": device.type,
        "config": {
            "layers": config.num_hidden_layers,
            "h": config.hidden_size,
            "ffn": config.intermediate_size,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "head_dim": head_dim,
            "vocab": config.vocab_size,
            "b": args.batch_size,
            "s": args.seq_length,
            "dtype": str(base.dtype).removeprefix("torch."),
            "dtype_size": base.dtype.itemsize,
            "seed": args.seed,
        },
        "sequence_parallel": args.sequence_parallel,
        "padded_s": ids.size(1),
        "plan": plan_rows(plan, args.sequence_parallel),
        "parameters": parameters,
        "held": {
            "local": sum(torch.Size(r["local_shape"]).numel() for r in parameters),
            "whole": sum(torch.Size(r["shape"]).numel() for r in parameters),
        },
        "collectives": collective_rows(comm),
        "loss": round(loss.item(), 6),
        "loss_unsharded": round(oracle_loss.item(), 6),
        "grads_equal": grad_diff <= GRAD_TOLERANCE,
        "partial_grads": partial,
    }


def cells(rows: list[dict]) -> str:
    return ", ".join(
        f"{r['kind']} {r['count']} x {r['each']:,} B"
        if r["each"] is not None
        else f"{r['kind']} {r['count']} ({r['bytes']:,} B)"
        for r in rows
    )


def text(report: dict) -> str:
    c, p = report["config"], report["world"]
    lines = [
        f"Qwen2ForCausalLM from a config, random weights (seed {c['seed']}): {c['layers']} decoder layers, hidden "
        f"{c['h']}, MLP {c['ffn']}, {c['heads']} query heads and {c['kv_heads']} key/value heads of {c['head_dim']}, "
        f"vocabulary {c['vocab']}, {c['dtype']}",
        f"batch of {c['b']} sequences x {c['s']} tokens; tensor parallel over p = {p} rank{'s' if p > 1 else ''}, "
        f"a 1-D DeviceMesh on {report['device']}; sequence parallel: {'on' if report['sequence_parallel'] else 'off'}",
    ]
    if report["padded_s"] != c["s"]:
        lines.append(
            f"sequence padded from {c['s']} to {report['padded_s']} tokens (the pad's labels ignored); the "
            f"unsharded model runs the {c['s']} unpadded tokens"
        )
    width = max(len(r["module"]) for r in report["plan"]) + 2
    lines += ["", "plan (module -> style), applied with parallelize_module; model.layers.* is each decoder layer:"]
    lines += [f"  {r['module']:{width}}{r['style']}" for r in report["plan"]]
    first = [r for r in report["parameters"] if not re.match(r"model\.layers\.[1-9]", r["name"])]
    width = max(len(r["name"]) for r in first) + 2
    lines += [
        "",
        f"parameters on rank 0 (placement, local shape of the whole; {PLAIN}: an ordinary tensor, whole "
        "on every rank):",
    ]
    for r in first:
        shape = f"{r['local_shape']} of {r['shape']}" if r["local_shape"] != r["shape"] else f"{r['shape']}"
        lines.append(f"  {r['name']:{width}}{r['placement']:14}{shape}")
    if c["layers"] > 1:
        others = "model.layers.1" + (f" to {c['layers'] - 1}" if c["layers"] > 2 else "")
        lines.append(f"  {others}: as model.layers.0")
    held = report["held"]
    lines.append(
        f"  rank 0 holds {held['local']:,} of the {held['whole']:,} parameters ({held['local'] / held['whole']:.2f})"
    )
    rows = report["collectives"]
    width = max(len(r["where"]) for r in rows) + 2
    lines += [
        "",
        "collectives of the step on rank 0, counted by CommDebugMode (bytes: the whole tensor each works on):",
    ]
    for name in dict.fromkeys(r["where"] for r in rows):
        label = "the whole step" if name == "step" else name
        for phase in ("forward", "backward"):
            mine = [r for r in rows if r["where"] == name and r["phase"] == phase]
            if mine:
                lines.append(f"  {label:{max(width, 16)}}{phase:10}{cells(mine)}")
                label = ""
    lines.append("")
    lines.append(
        f"loss {report['loss']:.6f}; the unsharded model, same weights and batch: {report['loss_unsharded']:.6f}; "
        f"gradients {'equal' if report['grads_equal'] else 'NOT equal'} within {GRAD_TOLERANCE:g}"
    )
    if report["partial_grads"]:
        names = list(dict.fromkeys(re.sub(r"layers\.\d+", "layers.*", n) for n in report["partial_grads"]))
        lines.append(
            f"gradients left Partial(sum) after backward ({len(report['partial_grads'])}; each rank's tokens only): "
            + ", ".join(names)
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> None:
    with one_line_errors(PACKAGE):
        plan = load_plan()
        if "RANK" not in os.environ:
            raise LaunchError(
                f"run under torchrun, e.g. .venv/bin/torchrun --standalone --nproc-per-node 2 -m {PACKAGE}"
            )
        world = int(os.environ.get("WORLD_SIZE", 1))
        check_sizes(plan.tiny_config(), args, world)
        with distributed(args.device) as device:
            report = step(plan, args, device, dist.get_world_size())
            if dist.get_rank() == 0:
                print(json.dumps(report) if args.json else text(report), flush=True)


def main(argv: list[str] | None = None) -> None:
    run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()

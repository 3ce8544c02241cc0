"""`python -m reference.measure.calibrate`: how fast this device runs the operations the modeled timelines draw.

The site re-times each recorded span from its FLOPs at a rate (tools/study/modeled.py). This
measures such rates here: every op of one transformer block, forward and backward, at the shapes the notes'
traces ran (tools/trace_worker.py) and at a 70B layer's per-rank shapes on TP 8 (reference/measure/scale/shapes.py,
as the scale traces lay it out). FLOPs are torch's own count (FlopCounterMode, on the meta device); time is
the median of the repeats after warmup, by CUDA events on a GPU, by the clock on the CPU. The JSON file names
the device, torch and dtype; copied to reading_notes/calibrations/NAME.json, a note draws a timeline at its
rates with `diagram(..., calibration="NAME")`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from reference.arguments import OneLineParser
from reference.measure.scale.shapes import MODELS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SCALE_TP = 8  # tools/study/record_traces.SCALE: the 70B scale traces run TP 8


@dataclasses.dataclass(frozen=True)
class Block:
    """One transformer block's sizes as one rank runs it: s x b tokens, hidden h, heads and FFN split tp ways."""

    name: str
    style: str  # "gpt2" (LayerNorm, fused QKV, GELU MLP) or "llama" (RMSNorm, grouped-query, SwiGLU)
    s: int
    b: int
    h: int
    heads: int
    kv_heads: int
    ffn: int
    tp: int = 1


_70B = MODELS["gpt-70b-shape"]
BLOCKS = {
    b.name: b
    for b in (
        Block("pipeline", "gpt2", s=8, b=2, h=16, heads=4, kv_heads=4, ffn=64),  # pipeline_*.json, a micro-batch
        Block("fsdp", "gpt2", s=16, b=2, h=32, heads=4, kv_heads=4, ffn=128),  # fsdp_forward.json, one rank
        *(
            Block(f"{trace}-h{h}", style, s=8, b=2, h=h, heads=4, kv_heads=kv, ffn=4 * h, tp=2)  # tp_block*.json
            for trace, style, kv in (("tp_block", "gpt2", 4), ("tp_block_llama", "llama", 2))
            for h in (64, 128)
        ),
        Block(
            f"70b-tp{SCALE_TP}",
            "gpt2",  # the scale traces' 70B runs the reference GPT: multi-head attention, GELU MLP
            s=_70B.seq_length,
            b=_70B.micro_batch_size,
            h=_70B.hidden_size,
            heads=_70B.num_attention_heads,
            kv_heads=_70B.num_attention_heads,
            ffn=_70B.ffn_hidden_size,
            tp=SCALE_TP,
        ),
    )
}


def grouped_attention(q, k, v):
    """Causal attention with fewer key/value heads than query heads, as the Llama block runs it."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def block_ops(block: Block) -> list[tuple[str, Callable, list[list[int]]]]:
    """(name, function, input shapes) of each op of `block` on one rank, in forward order. Residual adds and
    rotary are left out: elementwise, as the norms and activations are, which stand for them."""
    t, h, d = block.tp, block.h, block.h // block.heads
    tokens, heads, kv, f = block.s * block.b, block.heads // t, block.kv_heads // t, block.ffn // t
    attention = [[block.b, heads, block.s, d], [block.b, kv, block.s, d], [block.b, kv, block.s, d]]
    if block.style == "llama":
        return [
            ("ln1", lambda x, w: F.rms_norm(x, (h,), w), [[tokens, h], [h]]),
            ("qkv", F.linear, [[tokens, h], [(heads + 2 * kv) * d, h]]),
            ("attention", grouped_attention, attention),
            ("proj", F.linear, [[tokens, heads * d], [h, heads * d]]),
            ("ln2", lambda x, w: F.rms_norm(x, (h,), w), [[tokens, h], [h]]),
            ("fc1", F.linear, [[tokens, h], [2 * f, h]]),  # [gate; up]
            ("swiglu", lambda y: F.silu(y[:, :f]) * y[:, f:], [[tokens, 2 * f]]),
            ("fc2", F.linear, [[tokens, f], [h, f]]),
        ]
    return [
        ("ln1", lambda x, w, b: F.layer_norm(x, (h,), w, b), [[tokens, h], [h], [h]]),
        ("qkv", F.linear, [[tokens, h], [3 * heads * d, h], [3 * heads * d]]),
        ("attention", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), attention),
        ("proj", F.linear, [[tokens, heads * d], [h, heads * d], [h]]),
        ("ln2", lambda x, w, b: F.layer_norm(x, (h,), w, b), [[tokens, h], [h], [h]]),
        ("fc1", F.linear, [[tokens, h], [f, h], [f]]),
        ("gelu", F.gelu, [[tokens, f]]),
        ("fc2", F.linear, [[tokens, f], [h, f], [h]]),
    ]


def counted_flops(fn: Callable, shapes: list[list[int]], dtype: torch.dtype) -> tuple[int, int]:
    """(forward, backward) FLOPs of `fn` as torch counts them, on meta tensors (nothing computed). Attention is
    counted on the math backend, which has a formula on every torch: the FLOPs the math defines, whichever
    kernel then runs it."""
    inputs = [torch.empty(shape, device="meta", dtype=dtype, requires_grad=True) for shape in shapes]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as forward:
        out = fn(*inputs)
    with FlopCounterMode(display=False) as backward:
        torch.autograd.grad(out, inputs, torch.empty_like(out))
    return forward.get_total_flops(), backward.get_total_flops()


def median_seconds(run: Callable, device: torch.device, warmup: int, repeats: int) -> float:
    """The median time of `run()` over `repeats` after `warmup` runs: CUDA events around each run on a GPU (the
    kernels' time on the device), else the clock around a run that returns when its work is done."""
    for _ in range(warmup):
        run()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            begin = time.perf_counter()
            run()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _rate(flops: int, seconds: float) -> dict:
    return {"flops": flops, "seconds": seconds, "tflops": flops / seconds / 1e12 if seconds > 0 else 0.0}


def measure_op(fn: Callable, shapes: list[list[int]], device, dtype, warmup: int, repeats: int) -> list[tuple]:
    """(phase, FLOPs, median seconds) of `fn` on random inputs of `shapes`: forward (building the autograd
    graph, as in training) and backward (the gradients of all its inputs)."""
    inputs = [torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for shape in shapes]
    out = fn(*inputs)
    grad = torch.randn_like(out)
    forward, backward = counted_flops(fn, shapes, dtype)
    return [
        ("forward", forward, median_seconds(lambda: fn(*inputs), device, warmup, repeats)),
        (
            "backward",
            backward,
            median_seconds(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True), device, warmup, repeats),
        ),
    ]


def measure_block(block: Block, device: torch.device, dtype: torch.dtype, warmup: int, repeats: int) -> dict:
    """Every op of `block`, and the block's aggregate per phase: its FLOPs over its seconds."""
    ops = [
        {"op": name, "phase": phase, "shapes": shapes, **_rate(flops, seconds)}
        for name, fn, shapes in block_ops(block)
        for phase, flops, seconds in measure_op(fn, shapes, device, dtype, warmup, repeats)
    ]
    totals = {
        phase: _rate(
            sum(op["flops"] for op in ops if op["phase"] == phase),
            sum(op["seconds"] for op in ops if op["phase"] == phase),
        )
        for phase in ("forward", "backward")
    }
    return {**dataclasses.asdict(block), "ops": ops, **totals}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        return next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "CPU"


def calibrate(device: torch.device, dtype_name: str, names: list[str], warmup: int, repeats: int) -> dict:
    """The calibration document: the device, torch and dtype, and each named block measured."""
    dtype, blocks = DTYPES[dtype_name], []
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the events and the default stream are the current device's
    for name in names:
        begin = time.perf_counter()
        blocks.append(measure_block(BLOCKS[name], device, dtype, warmup, repeats))
        print(
            f"calibrate: {name}: forward {blocks[-1]['forward']['tflops']:.4g} TFLOP/s, backward "
            f"{blocks[-1]['backward']['tflops']:.4g} TFLOP/s ({time.perf_counter() - begin:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    return {
        "kind": "calibration",
        "version": 1,
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(dtype).removeprefix("torch."),
        "warmup": warmup,
        "repeats": repeats,
        "timing": "median of CUDA events" if device.type == "cuda" else "median of time.perf_counter",
        "blocks": blocks,
    }


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` whole or not at all: written beside it, then renamed over it."""
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(scratch, path)
    except BaseException:
        os.unlink(scratch)
        raise


def _count(least: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m reference.measure.calibrate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n", 1)[1]
        + "\nblocks (--only):\n"
        + "\n".join(
            f"  {b.name:20} {b.style}, tp {b.tp}: s {b.s} x b {b.b} tokens, h {b.h}, {b.heads} heads "
            f"({b.kv_heads} key/value), ffn {b.ffn}"
            for b in BLOCKS.values()
        )
        + "\n\nexample: python -m reference.measure.calibrate --out reading_notes/calibrations/h200-bf16.json",
    )
    parser.add_argument("--device", help="a torch device: cuda, cuda:N or cpu (default: cuda when visible, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bf16 on cuda (as training runs), fp32 on cpu")
    parser.add_argument("--only", nargs="+", choices=BLOCKS, metavar="BLOCK", help="measure only these blocks")
    parser.add_argument("--warmup", type=_count(0), default=5, help="untimed runs of each op first (default 5)")
    parser.add_argument("--repeats", type=_count(1), default=20, help="timed runs of each op (default 20)")
    parser.add_argument(
        "--out", type=Path, default=Path("calibration.json"), help="the file to write (default calibration.json)"
    )
    parser.add_argument("--json", action="store_true", help="print the file's JSON instead of a summary")
    return parser


def parse_device(parser: argparse.ArgumentParser, text: str | None) -> torch.device:
    if text is None:
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        parser.error(f"--device {text!r} is not a torch device; use cuda, cuda:N or cpu")
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device {text!r}: only cuda and cpu are measured")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {text!r}: no CUDA device is visible to torch {torch.__version__}")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"--device {text!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = parse_device(parser, args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if args.out.is_dir() or not args.out.parent.is_dir():
        parser.error(f"--out {str(args.out)!r}: not a file in an existing folder")
    names = args.only or list(BLOCKS)
    try:
        document = calibrate(device, dtype, names, args.warmup, args.repeats)
    except torch.cuda.OutOfMemoryError:
        print(f"{parser.prog}: error: {device} ran out of memory; measure fewer blocks with --only", file=sys.stderr)
        return 1
    text = json.dumps(document, indent=1) + "\n"
    try:
        write_atomically(args.out, text)
    except OSError as exc:
        print(f"{parser.prog}: error: cannot write {args.out}: {exc.strerror}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(text)
    else:
        print(f"{document['device']}, torch {document['torch']}, {document['dtype']}: TFLOP/s ({document['timing']})")
        for block in document["blocks"]:
            forward, backward = block["forward"]["tflops"], block["backward"]["tflops"]
            print(f"  {block['name']:20} forward {forward:9.4g}  backward {backward:9.4g}")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

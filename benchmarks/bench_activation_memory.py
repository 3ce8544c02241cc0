"""Activation bytes per transformer layer against Korthikanti et al. 2022 Table 2, per configuration, in one run.

    torchrun --nproc-per-node 2 benchmarks/bench_activation_memory.py [--seq-length 256 --hidden-size 512 ...]
    torchrun --nproc-per-node 1 benchmarks/bench_activation_memory.py        # on the GPU when one is visible

One reference block per configuration: no parallelism, tensor parallel, + sequence parallel, + selective
recompute, full recompute, with t = the number of ranks; the GPT-2 block (dropout 0.1) and the Llama block
(RMSNorm, rotary, grouped-query attention with --num-kv-heads, SwiGLU of --ffn-hidden-size, no dropout), or
one of them with --model; bf16 parameters and activations.
CPU: the bytes autograd keeps for backward, counted with saved-tensor hooks (reference.measure.activation_memory), next
to the closed form (GPT-2: the paper's; Llama: llama_block.FORMULAS, with Table 2 for a GPT-2 layer of the same
s, b, h, a, t beside it), then with --terms the term table that explains every byte (--json: all of it as
JSON, the trace the scale page renders: GPT-2 at the top level, Llama under "llama").
CUDA (one GPU, t = 1): the same hook count, and torch.cuda.max_memory_allocated over the forward (what the
forward left allocated, the output excluded), both next to the paper's. The CUDA path uses public torch only
(no reference.measure.torch_patches), so it runs on other torch versions than the pinned one.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from reference.arguments import OneLineParser, add_device_argument, add_flag
from reference.distributed import distributed, one_line_errors
from reference.measure.activation_memory.measure import MODELS, Count, build_block, count_all
from reference.measure.activation_memory.paper import Setting


def cuda_bytes(x: Setting, tp_group, device) -> tuple[int, int]:
    """(memory the forward left allocated beyond its output, peak allocated during it), both measured from
    the allocator with the block's weights and input already in place."""
    block, inputs = build_block(x, tp_group, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    output = block(*inputs)
    torch.cuda.synchronize(device)
    retained = torch.cuda.memory_allocated(device) - before - output.untyped_storage().nbytes()
    return retained, torch.cuda.max_memory_allocated(device) - before


def print_counts(model: str, counts: list[Count], measured, terms: bool) -> None:
    """One model's table: closed form, counted bytes and, on CUDA, the allocator's; with `terms` the rows."""
    closed_form = "Table 2" if model == "gpt2" else "closed form"
    if model == "llama":
        print("\nllama (Table 2: a GPT-2 layer of the same s, b, h, a, t)")
    else:
        print("\ngpt2")
    head = f"{'configuration':<50} {'Table 2':>12} {'counted':>12} {'ratio':>6}"
    print(head + (f" {'allocated':>12} {'ratio':>6} {'peak':>12}" if measured else ""))
    for i, c in enumerate(counts):
        line = (
            f"{c.configuration:<50} {c.table2_bytes:>12,} {c.counted_bytes:>12,} "
            f"{c.counted_bytes / c.table2_bytes:>6.3f}"
        )
        if measured:
            retained, peak = measured[i]
            line += f" {retained:>12,} {retained / c.table2_bytes:>6.3f} {peak:>12,}"
        print(line)
    for c in counts if terms else []:
        print(f"\n{model}, {c.configuration} ({closed_form} {c.formula}): {'paper':>10} {'counted':>10}  reason")
        for r in c.rows:
            print(f"  {r.term:<60} {r.paper_bytes:>10,} {r.measured_bytes:>10,}  {r.reason}")


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--seq-length", type=int, default=256)
    add_flag(parser, "--micro-batch-size", "--batch-size", dest="batch_size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=4, help="Llama: key/value heads (default 4)")
    parser.add_argument("--ffn-hidden-size", type=int, help="Llama: SwiGLU size (default 4 x hidden size)")
    add_device_argument(
        parser, "auto: one GPU per rank when there are enough (the CUDA columns), else CPU (the term tables)"
    )
    parser.add_argument("--terms", action="store_true", help="print each configuration's term table (CPU)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the counts as one JSON object instead (tools/record-traces records it as "
        "reading_notes/traces/activation_memory.json, which the scale page shows)",
    )
    args = parser.parse_args(argv)
    shape = dict(s=args.seq_length, b=args.batch_size, h=args.hidden_size, a=args.num_attention_heads)
    shapes = {
        "gpt2": shape,
        "llama": dict(shape, k=args.num_kv_heads, f=args.ffn_hidden_size or 4 * args.hidden_size),
    }
    models = list(MODELS) if args.model == "both" else [args.model]
    with one_line_errors("bench_activation_memory"):  # sizes the blocks cannot be split by, a failed launch
        run(args, shapes, models)


def run(args, shapes: dict[str, dict], models: list[str]) -> None:
    """Count every configuration of each model; rank 0 prints the tables or the JSON."""
    with distributed(args.device) as device:
        world, rank = dist.get_world_size(), dist.get_rank()
        single = [dist.new_group([r]) for r in range(world)][rank]
        groups = {1: single, world: dist.group.WORLD}
        counts = {
            m: count_all(m, shapes[m], tp_groups=groups, device=device, explain=device.type == "cpu") for m in models
        }
        measured = {
            m: [cuda_bytes(c.setting, groups[c.setting.t], device) for c in counts[m]]
            if device.type == "cuda"
            else None
            for m in models
        }
        if rank:
            return
        if args.json:
            out = {"kind": "activation_memory", "world": world, "device": device.type}
            for m in models:
                configurations = [c.to_dict() for c in counts[m]]
                for c, (retained, peak) in zip(configurations, measured[m] or []):
                    c.update(cuda_allocated_bytes=retained, cuda_peak_bytes=peak)
                model_out = {"shape": shapes[m], "configurations": configurations}
                if m == "gpt2":
                    out.update(model_out)
                else:
                    out["llama"] = model_out
            print(json.dumps(out, indent=1))
            return
        print(
            f"s {args.seq_length}, b {args.batch_size}, h {args.hidden_size}, a {args.num_attention_heads}, "
            f"t {world}, bf16, {device.type}"
            + (f" ({torch.cuda.get_device_name(device)}, torch {torch.__version__})" if device.type == "cuda" else "")
            + (f"; llama: k {shapes['llama']['k']}, f {shapes['llama']['f']}" if "llama" in models else "")
        )
        for m in models:
            print_counts(m, counts[m], measured[m], args.terms and device.type == "cpu")


if __name__ == "__main__":
    main()

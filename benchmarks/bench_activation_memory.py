"""Activation bytes per transformer layer against Korthikanti et al. 2022 Table 2, per configuration, in one run.

    torchrun --nproc-per-node 2 benchmarks/bench_activation_memory.py [--seq-length 256 --hidden-size 512 ...]
    torchrun --nproc-per-node 1 benchmarks/bench_activation_memory.py --device cuda

One reference GPT-2 block (bf16 parameters and activations, dropout 0.1) per configuration: no parallelism,
tensor parallel, + sequence parallel, + selective recompute, full recompute, with t = the number of ranks.
CPU: the bytes autograd keeps for backward, counted with saved-tensor hooks (reference.activation_memory), next
to the paper's closed form, then with --terms the term table that explains the difference (--json: all of it
as JSON, the trace the scale page renders).
CUDA (one GPU, t = 1): the same hook count, and torch.cuda.max_memory_allocated over the forward (what the
forward left allocated, the output excluded), both next to the paper's. The CUDA path uses public torch only
(no reference.torch_patches), so it runs on other torch versions than the pinned one.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from reference.activation_memory.measure import build_block, count_all, layer_input
from reference.activation_memory.paper import Setting
from reference.arguments import OneLineParser
from reference.distributed import distributed


def cuda_bytes(x: Setting, tp_group, device) -> tuple[int, int]:
    """(memory the forward left allocated beyond its output, peak allocated during it), both measured from
    the allocator with the block's weights and input already in place."""
    block = build_block(x, tp_group, device)
    inputs = layer_input(x, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    output = block(inputs)
    torch.cuda.synchronize(device)
    retained = torch.cuda.memory_allocated(device) - before - output.untyped_storage().nbytes()
    return retained, torch.cuda.max_memory_allocated(device) - before


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--terms", action="store_true", help="print each configuration's term table (CPU)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the counts as one JSON object instead (tools/record-traces records it as "
        "reading_notes/traces/activation_memory.json, which the scale page shows)",
    )
    args = parser.parse_args()
    with distributed(args.device) as device:
        world, rank = dist.get_world_size(), dist.get_rank()
        single = [dist.new_group([r]) for r in range(world)][rank]
        groups = {1: single, world: dist.group.WORLD}
        shape = dict(s=args.seq_length, b=args.batch_size, h=args.hidden_size, a=args.num_attention_heads)
        counts = count_all(**shape, tp_groups=groups, device=device, explain=device.type == "cpu")
        measured = (
            [cuda_bytes(c.setting, groups[c.setting.t], device) for c in counts] if device.type == "cuda" else None
        )
        if rank:
            return
        if args.json:
            configurations = [c.to_dict() for c in counts]
            for c, (retained, peak) in zip(configurations, measured or []):
                c.update(cuda_allocated_bytes=retained, cuda_peak_bytes=peak)
            print(
                json.dumps(
                    {
                        "kind": "activation_memory",
                        "world": world,
                        "device": device.type,
                        "shape": shape,
                        "configurations": configurations,
                    },
                    indent=1,
                )
            )
            return
        print(
            f"s {args.seq_length}, b {args.batch_size}, h {args.hidden_size}, a {args.num_attention_heads}, "
            f"t {world}, bf16, {device.type}"
            + (f" ({torch.cuda.get_device_name(device)}, torch {torch.__version__})" if measured else "")
        )
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
        if args.terms and device.type == "cpu":
            for c in counts:
                print(f"\n{c.configuration}: {'paper':>10} {'counted':>10}  reason")
                for r in c.rows:
                    print(f"  {r.term:<58} {r.paper_bytes:>10,} {r.measured_bytes:>10,}  {r.reason}")


if __name__ == "__main__":
    main()

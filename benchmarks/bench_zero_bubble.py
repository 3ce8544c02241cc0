"""ZB-V, the reference's step against torch's `ScheduleZBVZeroBubble`, on the same chunks: one run, a few sizes.

    torchrun --nproc-per-node 2 benchmarks/bench_zero_bubble.py [--hidden-sizes 64 128 256] [--json]
    torchrun --nproc-per-node 2 benchmarks/bench_zero_bubble.py --schedule dualpipev   # or zb-h1

Every rank is one pipeline rank (pp = world) and holds two stages of the V (rank r: stages r and 2p - 1 - r).
Per hidden size, both run one training step's forwards and backwards over the same GPT chunks (reference.gpt:
the same seed, so the same weights) and the same micro-batches, interleaved round by round so that machine
noise hits them alike (benchmarks/_harness.py):
  * reference: reference.pipeline.schedules.forward_backward, its order of F / I / W actions
               (reference.pipeline.zero_bubble) run by reference.pipeline.zero_bubble_run, the linears'
               weight gradients deferred by reference.tensor_parallel.deferred_wgrad;
  * torch:     torch.distributed.pipelining's schedule over PipelineStage's of the same chunks
               (tests/reference/torch_pipelines.py, the oracle the tests step), its backward split by
               `_backward.stage_backward_input` / `stage_backward_weight`.
A step is timed from a barrier to the end of its slowest rank (gradients cleared before each). Printed by
rank 0: per size the median and fastest step of each and the ratio reference / torch (the issue's target: at
most 1.1), and the micro-batch losses of the first step of each, which must be equal.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _harness import interleaved_times

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.reference

from reference.arguments import add_device_argument
from reference.distributed import distributed, one_line_errors
from reference.gpt.model import GPTConfig
from reference.gpt.parallelize import build_chunks
from reference.gpt.train import split_batch, synthetic_batches
from reference.parallel_state import ParallelConfigError, build_layout
from reference.pipeline.schedules import forward_backward
from reference.pipeline.zero_bubble import ZERO_BUBBLE_SCHEDULES, check_zero_bubble, stages_of
from tests.reference.torch_pipelines import step_torch, torch_schedule


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--schedule", choices=ZERO_BUBBLE_SCHEDULES, default="zbv")
    parser.add_argument("--hidden-sizes", type=int, nargs="+", default=[64, 128, 256], metavar="H")
    parser.add_argument("--num-layers", type=int, default=4, help="a multiple of 2 x pp for a V")
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches m per step")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps of each, in turn, after one untimed")
    parser.add_argument("--seed", type=int, default=1234)
    add_device_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object on one line (rank 0)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with one_line_errors("bench_zero_bubble"):
        if min(args.rounds, args.micro_batches, args.micro_batch_size, *args.hidden_sizes) < 1:
            raise ParallelConfigError("--rounds, --micro-batches, --micro-batch-size, --hidden-sizes must be >= 1")
        with distributed(args.device) as device:
            layout = build_layout(1, dist.get_world_size(), 1)
            rows = [_one_size(args, layout, hidden, device) for hidden in args.hidden_sizes]
        if rows[0] is not None:  # rank 0
            report = {
                "schedule": args.schedule,
                "pp": rows[0].pop("pp"),
                "device": device.type,
                "micro_batches": args.micro_batches,
                "rounds": args.rounds,
                "rows": rows,
            }
            print(json.dumps(report) if args.json else _text(report, args), flush=True)


def _one_size(args, layout, hidden: int, device: torch.device) -> dict | None:
    """Both steps at one hidden size, timed in turn; rank 0 returns the row (the other ranks None)."""
    config = GPTConfig(
        vocab_size=args.vocab_size,
        hidden_size=hidden,
        num_attention_heads=args.num_attention_heads,
        num_layers=args.num_layers,
        seq_length=args.seq_length,
    )
    p, r, m = layout.pp_size, layout.pp_rank, args.micro_batches
    check_zero_bubble(args.schedule, p, m, config.num_layers)
    stages = stages_of(args.schedule, p, r)
    tokens = synthetic_batches(config, 1, args.micro_batch_size * m, args.seed)[0].to(device)
    micro_batches = split_batch(tokens, 1, 0, m)
    ours, theirs = (
        build_chunks(config, layout, len(stages), schedule=args.schedule, seed=args.seed, device=device)
        for _ in range(2)
    )
    oracle = torch_schedule(args.schedule, theirs, stages, layout.pp_group, m)

    def cleared(chunks, step):
        for chunk in chunks:
            for param in chunk.parameters():
                param.grad = None
        return step()

    steps = {
        "reference": functools.partial(
            cleared,
            ours,
            functools.partial(
                forward_backward,
                args.schedule,
                ours,
                micro_batches,
                pp_group=layout.pp_group,
                activation_shape=ours[0].activation_shape(args.micro_batch_size),
                device=device,
            ),
        ),
        "torch": functools.partial(
            cleared, theirs, lambda: [loss.item() for loss in step_torch(oracle, tokens, stages, p)]
        ),
    }
    first = {name: step() for name, step in steps.items()}  # also the warm-up
    times = interleaved_times(steps, args.rounds, device.type == "cuda")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (times, first))
    if r != 0:
        return None
    slowest = {name: [max(t[name][k] for t, _ in everyone) for k in range(args.rounds)] for name in steps}
    losses = {name: [loss for _, f in everyone for loss in f[name]] for name in steps}  # the last stage's rank
    median = {name: statistics.median(t) * 1e3 for name, t in slowest.items()}
    best = {name: min(t) * 1e3 for name, t in slowest.items()}
    return {
        "pp": p,
        "hidden_size": hidden,
        "median_ms": median,
        "min_ms": best,
        "ratio_median": median["reference"] / median["torch"],
        "ratio_min": best["reference"] / best["torch"],
        "losses": losses,
        "losses_equal": losses["reference"] == losses["torch"],
    }


def _text(report: dict, args) -> str:
    lines = [
        f"{report['schedule']} at pp {report['pp']} on {report['device']}: layers={args.num_layers} "
        f"s={args.seq_length} m={report['micro_batches']} micro-batches of {args.micro_batch_size}; median and "
        f"fastest of {report['rounds']} interleaved steps each (slowest rank)",
        f"{'hidden':>6} {'reference ms':>12} {'torch ms':>9} {'ref/torch':>9} {'fastest ref':>11} {'torch':>7} "
        f"{'ref/torch':>9}  losses",
    ]
    for row in report["rows"]:
        med, best = row["median_ms"], row["min_ms"]
        lines.append(
            f"{row['hidden_size']:6d} {med['reference']:12.2f} {med['torch']:9.2f} {row['ratio_median']:9.3f} "
            f"{best['reference']:11.2f} {best['torch']:7.2f} {row['ratio_min']:9.3f}  "
            + ("equal" if row["losses_equal"] else f"DIFFER {row['losses']}")
        )
    lines.append("target: reference / torch <= 1.1")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

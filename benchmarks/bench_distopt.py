"""DDP with Megatron's mixed precision optimizer against the distributed optimizer (ZeRO-1): bytes per rank,
traffic per step and step time, side by side in one run.

    torchrun --nproc-per-node 4 benchmarks/bench_distopt.py [--hidden-size 128 --num-layers 4]

Three copies of the same bf16 transformer (reference.tensor_parallel.transformer, same seed) train with Adam on
the same batches over the whole world as one DP group, interleaved step by step:
  * ddp              fp32 main_grad buckets all-reduced; fp32 masters and Adam states of every parameter on
                     every rank (reference.data_parallel.mixed_precision.unsharded)
  * distopt          the same buckets reduce-scattered; this rank's 1/N slice of masters and Adam states; the
                     bf16 parameter buckets all-gathered after the step
  * distopt overlap  the all-gathers waited for in the next forward (overlap_param_gather)
Every variant must report the same losses (the distributed optimizer is bit-exact, tests/reference/
test_distributed_optimizer.py); the largest difference is printed.

Printed by rank 0 (`--json`: one object instead): per variant the bytes per rank of parameters, gradients, fp32
masters and optimizer states (reference.data_parallel.distributed_optimizer.bytes_per_rank) next to the closed
forms, 2Ψ + 4Ψ + 12Ψ (DDP) and 2Ψ + 4Ψ + 12Ψ/N (Megatron's distributed optimizer with fp32 gradients; the
ZeRO paper's 2Ψ + 2Ψ + 12Ψ/N counts 16-bit gradients), Ψ the padded bucket elements; the DP traffic of one
recorded step (CollectiveRecorder nbytes, full buffers) and the bytes a ring sends per rank for it
(all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N each); step time, fastest and median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from _harness import add_sizes

from reference.arguments import add_device_argument, add_flag, steps
from reference.data_parallel import DistributedDataParallel
from reference.data_parallel.buckets import padded_numel
from reference.data_parallel.distributed_optimizer import DistributedOptimizer, bytes_per_rank
from reference.data_parallel.mixed_precision import unsharded
from reference.distributed import distributed, one_line_errors
from reference.gpt.model import gpt_blocks
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import ParallelConfigError

VARIANTS = {"ddp": (False, False), "distopt": (True, False), "distopt overlap": (True, True)}
RING = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}  # x (N-1)/N of the full buffer, per rank


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_sizes(parser, hidden_size=128, num_attention_heads=4, num_layers=4, seq_length=32)
    add_flag(
        parser,
        "--micro-batch-size",
        "--batch-size",
        dest="batch_size",
        type=int,
        default=4,
        help="sequences per rank and step",
    )
    parser.add_argument("--bucket-size", type=int, default=2**19, metavar="BYTES", help="gradient bucket size")
    parser.add_argument("--steps", type=steps, default=10, help="timed steps per variant (interleaved)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", action="store_true", help="print one JSON object (rank 0) instead of tables")
    add_device_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with one_line_errors("bench_distopt"):
        if min(args.steps, args.batch_size, args.bucket_size, args.hidden_size, args.num_layers) < 1:
            raise ParallelConfigError(
                "--steps, --micro-batch-size, --bucket-size, --hidden-size and --num-layers must be >= 1"
            )
        with distributed(args.device) as device:
            if dist.get_world_size() < 2:
                raise ParallelConfigError(
                    "the distributed optimizer needs a data-parallel group of at least 2 "
                    "ranks; run under torchrun --nproc-per-node N, N >= 2"
                )
            _benchmark(args, device)


def _benchmark(args, device: torch.device) -> None:
    n, group = dist.get_world_size(), dist.group.WORLD
    models, optimizers = {}, {}
    for label, (sharded, overlap) in VARIANTS.items():
        torch.manual_seed(args.seed)
        module = gpt_blocks(
            args.num_layers, args.hidden_size, args.num_attention_heads, params_dtype=torch.bfloat16, device=device
        )
        models[label] = DistributedDataParallel(
            module,
            group,
            bucket_size=args.bucket_size,
            grad_dtype=torch.float32,
            use_distributed_optimizer=sharded,
            overlap_param_gather=overlap,
        )
        make = lambda tensors: torch.optim.Adam(tensors, lr=args.lr)
        optimizers[label] = DistributedOptimizer(models[label], make) if sharded else unsharded(models[label], make)
    generator = torch.Generator().manual_seed(args.seed + 1)
    batches = [
        torch.randn(args.seq_length, args.batch_size * n, args.hidden_size, generator=generator).to(device)
        for _ in range(args.steps + 1)
    ]

    def step(label: str, x: torch.Tensor, record: CollectiveRecorder | None = None) -> tuple[float, float]:
        model, optimizer = models[label], optimizers[label]
        local = x.chunk(n, dim=1)[dist.get_rank()].to(torch.bfloat16)
        dist.barrier()
        start = time.perf_counter()
        with record or CollectiveRecorder():
            loss = (model(None, None, hidden=local).float() ** 2).mean()
            loss.backward()
            model.finish_grad_sync()
            optimizer.step()
            model.zero_grad()
        return loss.item(), time.perf_counter() - start

    losses = {label: [] for label in VARIANTS}
    times = {label: [] for label in VARIANTS}
    for x in batches[:-1]:
        for label in VARIANTS:
            loss, seconds = step(label, x)
            losses[label].append(loss)
            times[label].append(seconds)
    traffic = {}
    for label in VARIANTS:  # one more step each, recorded (its forward waits for the last step's all-gathers)
        recorder = CollectiveRecorder()
        step(label, batches[-1], recorder)
        ops = recorder.summary()
        traffic[label] = {
            "collectives": ops,
            "ring_bytes_per_rank": sum(RING[op] * v["bytes"] * (n - 1) // n for op, v in ops.items()),
        }
    slowest = torch.tensor([[statistics.median(times[label]), min(times[label])] for label in VARIANTS])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return
    psi = sum(bucket.numel for bucket in models["ddp"].buckets)
    padded = sum(padded_numel(bucket.numel, n) for bucket in models["ddp"].buckets)
    report = {
        "world": n,
        "device": device.type,
        "psi": psi,
        "psi_padded": padded,
        "max_loss_difference": max(abs(a - b) for label in VARIANTS for a, b in zip(losses[label], losses["ddp"])),
        "variants": {},
    }
    for (label, (sharded, _)), (median, fastest) in zip(VARIANTS.items(), slowest.tolist()):
        held = bytes_per_rank(models[label], optimizers[label])
        p = padded if sharded else psi
        report["variants"][label] = {
            "bytes": held,
            "total_bytes": sum(held.values()),
            "formula_bytes": 2 * p + 4 * p + (12 * p // n if sharded else 12 * p),
            **traffic[label],
            "median_s": median,
            "fastest_s": fastest,
        }
    if args.json:
        print(json.dumps(report), flush=True)
        return
    print(
        f"DP {n} on {device.type}, Ψ = {psi:,} parameters ({padded:,} padded to a multiple of {n} per bucket); "
        f"largest loss difference from ddp: {report['max_loss_difference']}"
    )
    print(
        f"{'variant':<16} {'params':>10} {'grads':>10} {'masters':>10} {'states':>10} {'total':>11} "
        f"{'formula':>11} {'ring B/rank':>12} {'fastest ms':>11} {'median ms':>10}"
    )
    for label, v in report["variants"].items():
        b = v["bytes"]
        print(
            f"{label:<16} {b['parameters']:>10,} {b['gradients']:>10,} {b['master_weights']:>10,} "
            f"{b['optimizer_states']:>10,} {v['total_bytes']:>11,} {v['formula_bytes']:>11,} "
            f"{v['ring_bytes_per_rank']:>12,} {v['fastest_s'] * 1e3:>11.1f} {v['median_s'] * 1e3:>10.1f}"
        )
    ddp, distopt = report["variants"]["ddp"], report["variants"]["distopt"]
    print(
        f"distopt / ddp: bytes per rank {distopt['total_bytes'] / ddp['total_bytes']:.3f} (closed form "
        f"(6 + 12/{n}) / 18 = {(6 + 12 / n) / 18:.3f}), ring traffic "
        f"{distopt['ring_bytes_per_rank'] / ddp['ring_bytes_per_rank']:.3f} (fp32 grads, bf16 params: 6/8)"
    )


if __name__ == "__main__":
    main()

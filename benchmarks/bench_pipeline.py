"""GPipe vs 1F1B vs interleaved 1F1B, and DP gradient all-reduce overlapped with backward vs not: one run.

    torchrun --nproc-per-node 4 benchmarks/bench_pipeline.py [--tp 1 --pp 4 --dp 1] [--micro-batches 8]
    torchrun --nproc-per-node 4 benchmarks/bench_pipeline.py --pp 2 --dp 2 [--bucket-size 524288]

Every variant trains its own copy of the same small GPT (reference.gpt: same seed, so the same weights) on the
same global batches with reference.gpt.train.train_step, interleaved step by step so that machine noise hits
them alike:
  * gpipe, 1f1b                  the two pipeline schedules, DP buckets overlapped with backward
  * interleaved                  1F1B over --virtual-stages V model chunks per stage (when V > 1 and the
                                 layers split into pp x V chunks and m is a multiple of pp; else skipped)
  * 1f1b no-overlap (dp > 1)     the DP bucket all-reduces issued after backward instead of as buckets fill
Since the data, weights and gradient summation order are the same, every variant must report the same loss
at every step; the largest difference is printed (it is 0 when nothing but the schedule differs).

Printed by rank 0 (`--json`: one object instead):
  * per pipeline stage (one rank per stage), memory: the peak bytes of saved activations and the peak number
    of micro-batches in flight, as the schedule counts them and as autograd holds them (reference.pipeline.
    in_flight), and the 1F1B/GPipe ratio of the bytes against the formula min(p - r, m) / m; time: the
    measured bubble (median over steps) against (p - 1) / (m + p - 1), and per variant the "replayed"
    bubble of the recorded orders under uniform costs (reference.measure.replay), which ranks sharing a
    few CPU cores cannot disturb. The formula assumes equal stages;
    here the first stage also embeds and the last one computes the loss. Interleaved: its peak bytes and
    chunk-forwards in flight against min(2 (p - r - 1) + (V - 1) p + 1, V m), its bubble against
    (p - 1) / (V m + p - 1).
  * per variant: step time (barrier, then train_step until the loss is known; the slowest rank), fastest and
    median over the timed steps, "tail": the median step time outside the schedule (gradient finalization,
    i.e. waiting for the DP all-reduces, optimizer step, loss report), and from one extra recorded step
    (CollectiveRecorder) the DP all-reduces issued while autograd was still running the last micro-batch's
    backward, out of all DP all-reduces, summed over stages.
  * ratios: 1F1B / GPipe and overlap / no-overlap step times, by fastest step and by median.
On a shared machine the fastest step is the least disturbed figure; medians show the typical cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from _harness import add_sizes

from reference.arguments import add_device_argument, steps
from reference.distributed import distributed, one_line_errors
from reference.gpt.model import GPTConfig, split_layers
from reference.gpt.parallelize import build_chunks, check_virtual_pipeline
from reference.gpt.train import data_parallel, synthetic_batches, train_step
from reference.measure.pipeline_meter import PipelineMeter
from reference.measure.recorder import CollectiveRecorder
from reference.measure.replay import idle_fraction
from reference.parallel_state import ParallelConfigError, build_layout
from reference.pipeline.schedules import SCHEDULES, bubble_formula, peak_in_flight_formula


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=None, help="pipeline stages; default: world / (tp x dp)")
    parser.add_argument(
        "--dp", type=int, default=None, help="data-parallel size; default: world / (tp x pp) when --pp is given, else 1"
    )
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches m per step and replica")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument(
        "--virtual-stages",
        type=int,
        default=2,
        metavar="V",
        help="model chunks per stage of the interleaved variant (1: no interleaved variant)",
    )
    add_sizes(parser, seq_length=32, hidden_size=128, num_attention_heads=4, num_layers=8, vocab_size=128)
    parser.add_argument(
        "--bucket-size",
        type=int,
        default=2**19,
        metavar="BYTES",
        help="DP gradient bucket size (small enough for several buckets per stage)",
    )
    parser.add_argument("--steps", type=steps, default=20, help="timed steps per variant (interleaved)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, default=1e-2)
    add_device_argument(parser)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on one line (rank 0) instead of tables"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with one_line_errors("bench_pipeline"):
        if (
            min(args.steps, args.micro_batches, args.micro_batch_size, args.bucket_size, args.virtual_stages) < 1
            or args.warmup < 0
        ):
            raise ParallelConfigError(
                "--steps, --micro-batches, --micro-batch-size, --bucket-size, --virtual-stages "
                "must be >= 1 and --warmup >= 0"
            )
        config = GPTConfig.from_sizes(args)
        with distributed(args.device) as device:
            _benchmark(args, config, device)


def _sizes(args, world: int) -> tuple[int, int, int | None]:
    if args.pp is None:
        dp = args.dp or 1
        return args.tp, max(1, world // (args.tp * dp)), dp
    return args.tp, args.pp, args.dp


def _interleaves(args, config: GPTConfig, p: int) -> bool:
    """Whether the interleaved variant runs: V > 1 chunks per stage of a pipeline that megatron-core would accept,
    i.e. that check_virtual_pipeline does not refuse."""
    if args.virtual_stages == 1:
        return False
    try:
        check_virtual_pipeline(config.num_layers, p, args.virtual_stages, args.micro_batches)
    except ParallelConfigError:
        return False
    return True


def _benchmark(args, config: GPTConfig, device: torch.device) -> None:
    cuda = device.type == "cuda"
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = build_layout(*_sizes(args, world))
    split_layers(config.num_layers, layout.pp_size)
    variants = [("gpipe", "gpipe", True), ("1f1b", "1f1b", True)]
    if _interleaves(args, config, layout.pp_size):
        variants.append(("interleaved", "1f1b", True))
    if layout.dp_size > 1:
        variants.append(("1f1b no-overlap", "1f1b", False))
    models, optimizers = {}, {}
    for label, _, overlap in variants:
        v = args.virtual_stages if label == "interleaved" else 1
        chunks = build_chunks(config, layout, v, seed=args.seed, device=device)
        wrapped = [
            data_parallel(chunk, layout, bucket_size=args.bucket_size, overlap_grad_reduce=overlap) for chunk in chunks
        ]
        models[label] = wrapped if label == "interleaved" else wrapped[0]
        optimizers[label] = torch.optim.SGD([p for chunk in wrapped for p in chunk.parameters()], lr=args.lr)
    global_batch = args.micro_batch_size * args.micro_batches * layout.dp_size
    batches = synthetic_batches(config, args.warmup + args.steps + 1, global_batch, args.seed)

    def step(label, schedule, tokens, record=None):
        model = models[label]
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start, meter = time.perf_counter(), PipelineMeter(device)
        loss = train_step(
            model,
            optimizers[label],
            tokens,
            layout,
            num_micro_batches=args.micro_batches,
            schedule=schedule,
            device=device,
            record=record,
            observer=meter,
        )
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, loss, meter

    mine = {
        label: {
            "times": [],
            "tails": [],
            "bubbles": [],
            "losses": [],
            "actions": [],
            "peak_bytes": 0,
            "peak_in_flight": 0,
            "peak_in_flight_measured": 0,
            "cuda_peak_bytes": 0,
        }
        for label, _, _ in variants
    }
    for index, tokens in enumerate(batches[:-1]):
        for label, schedule, _ in variants:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            seconds, loss, pipeline = step(label, schedule, tokens)
            record = mine[label]
            record["losses"].append(loss)
            record["actions"] = pipeline.actions
            record["peak_bytes"] = max(record["peak_bytes"], pipeline.peak_activation_bytes)
            record["peak_in_flight"] = max(record["peak_in_flight"], pipeline.peak_in_flight)
            record["peak_in_flight_measured"] = max(record["peak_in_flight_measured"], pipeline.peak_in_flight_measured)
            if cuda:
                record["cuda_peak_bytes"] = max(record["cuda_peak_bytes"], torch.cuda.max_memory_allocated())
            if index >= args.warmup:
                record["times"].append(seconds)
                record["tails"].append(seconds - pipeline.total_s)
                record["bubbles"].append(pipeline.wall_clock_bubble)

    dp_ranks = tuple(dist.get_process_group_ranks(layout.dp_group))
    for label, schedule, _ in variants:  # one more step, recorded: when were the DP all-reduces issued?
        recorder = CollectiveRecorder()
        _, loss, _ = step(label, schedule, batches[-1], record=recorder)
        mine[label]["losses"].append(loss)
        dp = [e for e in recorder.events if e.op == "all_reduce" and e.group_ranks == dp_ranks and len(dp_ranks) > 1]
        mine[label]["dp_all_reduces"] = len(dp)
        mine[label]["dp_all_reduces_in_backward"] = sum(e.phase == "backward" for e in dp)
    mine_all = {
        "coordinates": layout.coordinates(),
        "variants": mine,
        "buckets": len(models["1f1b"].buckets),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in models["1f1b"].module.parameters()),
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine_all)
    if rank == 0:
        report = _report(args, config, layout, device, variants, everyone)
        print(json.dumps(report) if args.json else _text(report), flush=True)


def _report(args, config, layout, device, variants, everyone) -> dict:
    p, m, v = layout.pp_size, args.micro_batches, args.virtual_stages
    labels = [label for label, _, _ in variants]
    stage_ranks = layout.grid[:, 0, 0].tolist()  # one rank per stage: dp 0, tp 0
    bounds = split_layers(config.num_layers, p)
    stages = []
    for r, global_rank in enumerate(stage_ranks):
        got = everyone[global_rank]["variants"]
        gpipe, one, chunked = got["gpipe"], got["1f1b"], got.get("interleaved")
        expected = {schedule: peak_in_flight_formula(schedule, p, r, m) for schedule in SCHEDULES}
        interleaved = (
            {}
            if chunked is None
            else {
                "interleaved_peak_bytes": chunked["peak_bytes"],
                "interleaved_peak_in_flight": chunked["peak_in_flight"],
                "interleaved_peak_in_flight_measured": chunked["peak_in_flight_measured"],
                "interleaved_expected_in_flight": peak_in_flight_formula("1f1b", p, r, m, v),
                "interleaved_bubble": statistics.median(chunked["bubbles"]),
                "interleaved_bubble_formula": bubble_formula(p, m, v),
            }
        )
        stages.append(
            {
                "pp_rank": r,
                "rank": global_rank,
                "layers": bounds[r][1] - bounds[r][0],
                "buckets": everyone[global_rank]["buckets"],
                "parameter_bytes": everyone[global_rank]["parameter_bytes"],
                **{
                    f"{name}_{key}": v[key]
                    for name, v in (("gpipe", gpipe), ("1f1b", one))
                    for key in ("peak_bytes", "peak_in_flight", "peak_in_flight_measured")
                },
                "peak_bytes_ratio": one["peak_bytes"] / gpipe["peak_bytes"] if gpipe["peak_bytes"] else None,
                "peak_bytes_ratio_formula": expected["1f1b"] / expected["gpipe"],
                "expected_in_flight": expected,
                "gpipe_bubble": statistics.median(gpipe["bubbles"]),
                "1f1b_bubble": statistics.median(one["bubbles"]),
                "bubble_formula": bubble_formula(p, m),
                **interleaved,
            }
        )
    step_times = {}
    for label in labels:  # a step takes as long as its slowest rank
        per_step = [max(e["variants"][label]["times"][k] for e in everyone) for k in range(args.steps)]
        tails = [max(e["variants"][label]["tails"][k] for e in everyone) for k in range(args.steps)]
        step_times[label] = {
            "fastest_s": min(per_step),
            "median_s": statistics.median(per_step),
            "tail_median_s": statistics.median(tails),
            "dp_all_reduces": sum(everyone[g]["variants"][label]["dp_all_reduces"] for g in stage_ranks),
            "dp_all_reduces_in_backward": sum(
                everyone[g]["variants"][label]["dp_all_reduces_in_backward"] for g in stage_ranks
            ),
            "cuda_peak_bytes": max(e["variants"][label]["cuda_peak_bytes"] for e in everyone) or None,
            "replayed_bubble": idle_fraction(
                [everyone[g]["variants"][label]["actions"] for g in stage_ranks],
                chunks=v if label == "interleaved" else 1,
            )
            if p > 1
            else 0.0,
            "bubble_formula": bubble_formula(p, m, v if label == "interleaved" else 1),
        }

    def ratio(a, b):
        return {stat: step_times[a][f"{stat}_s"] / step_times[b][f"{stat}_s"] for stat in ("fastest", "median")}

    ratios = {"1f1b/gpipe": ratio("1f1b", "gpipe")}
    if "interleaved" in step_times:
        ratios["interleaved/1f1b"] = ratio("interleaved", "1f1b")
    if "1f1b no-overlap" in step_times:
        ratios["overlap/no-overlap"] = ratio("1f1b", "1f1b no-overlap")
    losses = {label: everyone[0]["variants"][label]["losses"] for label in labels}
    difference = max(abs(a - b) for label in labels for a, b in zip(losses[label], losses["gpipe"]))
    return {
        "device": device.type,
        "backend": dist.get_backend(),
        "layout": {"tp": layout.tp_size, "pp": p, "dp": layout.dp_size},
        "model": {
            "hidden_size": config.hidden_size,
            "num_layers": config.num_layers,
            "seq_length": config.seq_length,
            "vocab_size": config.vocab_size,
        },
        "micro_batches": m,
        "micro_batch_size": args.micro_batch_size,
        "bucket_size": args.bucket_size,
        "virtual_stages": v if "interleaved" in labels else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "stages": stages,
        "variants": step_times,
        "ratios": ratios,
        "losses": losses,
        "max_loss_difference": difference,
    }


def _text(report: dict) -> str:
    lay, p, m = report["layout"], report["layout"]["pp"], report["micro_batches"]
    model = report["model"]
    lines = [
        f"tp {lay['tp']} x pp {p} x dp {lay['dp']} on {report['device']} ({report['backend']}); "
        f"h={model['hidden_size']} layers={model['num_layers']} s={model['seq_length']}, m={m} micro-batches "
        f"of {report['micro_batch_size']}, DP buckets of {report['bucket_size']} B "
        f"({'/'.join(str(s['buckets']) for s in report['stages'])} per stage); {report['steps']} timed "
        f"steps per variant, interleaved (after {report['warmup']} warm-up)",
        "per stage (rank dp 0, tp 0): peak saved activations and micro-batches in flight "
        "(schedule count / autograd), bubble median over steps",
        f"{'stage':>5} {'layers':>6} {'gpipe B':>9} {'1f1b B':>9} {'1f1b/gpipe':>10} {'min(p-r,m)/m':>12} "
        f"{'in flight gpipe':>15} {'1f1b':>7} {'bubble gpipe':>12} {'1f1b':>6} {'(p-1)/(m+p-1)':>13}",
    ]
    for s in report["stages"]:
        ratio = f"{s['peak_bytes_ratio']:.3f}" if s["peak_bytes_ratio"] is not None else "-"
        lines.append(
            f"{s['pp_rank']:5d} {s['layers']:6d} {s['gpipe_peak_bytes']:9d} {s['1f1b_peak_bytes']:9d} {ratio:>10} "
            f"{s['peak_bytes_ratio_formula']:12.3f} "
            f"{s['gpipe_peak_in_flight']:>7d} / {s['gpipe_peak_in_flight_measured']:<5d} "
            f"{s['1f1b_peak_in_flight']:>2d} / {s['1f1b_peak_in_flight_measured']:<2d} "
            f"{s['gpipe_bubble']:12.2f} {s['1f1b_bubble']:6.2f} {s['bubble_formula']:13.2f}"
        )
    if report["virtual_stages"]:
        v = report["virtual_stages"]
        lines.append(
            f"interleaved 1F1B, {v} chunks per stage: peak saved activations, chunk-forwards in flight "
            "(schedule / autograd / formula), bubble median against its formula, next to 1F1B's"
        )
        lines.append(
            f"{'stage':>5} {'1f1b B':>9} {'interl. B':>9} {'in flight 1f1b':>14} {'interleaved':>13} "
            f"{'bubble 1f1b':>11} {'(p-1)/(m+p-1)':>13} {'interleaved':>11} {'(p-1)/(vm+p-1)':>14}"
        )
        for s in report["stages"]:
            lines.append(
                f"{s['pp_rank']:5d} {s['1f1b_peak_bytes']:9d} {s['interleaved_peak_bytes']:9d} "
                f"{s['1f1b_peak_in_flight_measured']:>9d} / {s['expected_in_flight']['1f1b']:<2d} "
                f"{s['interleaved_peak_in_flight']:>3d} / {s['interleaved_peak_in_flight_measured']:>2d} / "
                f"{s['interleaved_expected_in_flight']:<2d} {s['1f1b_bubble']:11.2f} {s['bubble_formula']:13.2f} "
                f"{s['interleaved_bubble']:11.2f} {s['interleaved_bubble_formula']:14.2f}"
            )
    cuda = any(v["cuda_peak_bytes"] for v in report["variants"].values())
    lines.append(
        "per variant: step time (slowest rank), tail = median time after the schedule (DP wait, "
        "optimizer, loss report); DP all-reduces issued during the last backward / all (sum over stages)"
    )
    lines.append(
        f"{'variant':16} {'fastest ms':>10} {'median ms':>10} {'tail ms':>8} {'DP in bwd':>10} "
        f"{'replayed bubble':>15} {'formula':>7}" + (f" {'cuda peak MiB':>13}" if cuda else "")
    )
    for label, v in report["variants"].items():
        dp = f"{v['dp_all_reduces_in_backward']}/{v['dp_all_reduces']}" if lay["dp"] > 1 else "-"
        lines.append(
            f"{label:16} {v['fastest_s'] * 1e3:10.2f} {v['median_s'] * 1e3:10.2f} "
            f"{v['tail_median_s'] * 1e3:8.2f} {dp:>10} {v['replayed_bubble']:15.3f} "
            f"{v['bubble_formula']:7.3f}" + (f" {v['cuda_peak_bytes'] / 2**20:13.1f}" if cuda else "")
        )
    for name, r in report["ratios"].items():
        lines.append(f"step time {name:20s}: fastest {r['fastest']:.3f}   median {r['median']:.3f}")
    lines.append(
        f"losses of all variants, {len(report['losses']['gpipe'])} steps: max |difference| = "
        f"{report['max_loss_difference']:.3g} (last loss {report['losses']['gpipe'][-1]:.6f})"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

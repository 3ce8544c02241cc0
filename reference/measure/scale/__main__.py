"""`python -m reference.measure.scale --tp 8 --pp 8 --dp 64 --model llama3-70b [--rank R] [--sequence-parallel]
[--dp-sharding optimizer | gradients | fsdp2 [--dp-replicate R]] [--json]`: trace one training step of one rank (or a
first, middle and last stage rank) of a large job with the fake process group, and print the bytes per group
and collective type, and the bytes the rank holds, next to the closed-form formula. Exit 0 when every row
agrees, 1 when one does not, 2 for a setup that cannot exist."""

from __future__ import annotations

import argparse
import json
import sys
import time

from reference.arguments import (
    MAX_MICROBATCHES,
    MAX_WORLD,
    MICROBATCHES_WHY,
    WORLD_WHY,
    OneLineParser,
    add_flag,
    microbatches,
    refuse_large_world,
    routing_skew,
    world_size,
)
from reference.data_parallel.wrapper import DEFAULT_BUCKET_SIZE
from reference.measure.scale import cp_report, formulas, moe_report
from reference.measure.scale.moe_shapes import MOE_MODELS
from reference.measure.scale.shapes import MODELS, ScaleSetup, setup_for
from reference.measure.scale.simulate import RankStep, default_ranks, document, rows_table, stage_of, step_of
from reference.parallel_state import ORDERS, ParallelConfigError
from reference.pipeline.schedules import ALL_SCHEDULES
from reference.pipeline.zero_bubble import V_SCHEDULES


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m reference.measure.scale",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description=__doc__.split("\n\n")[0] + f" At most {MAX_WORLD:,} ranks ({WORLD_WHY}) and "
        f"{MAX_MICROBATCHES} micro-batches ({MICROBATCHES_WHY}).",
    )
    parser.add_argument(
        "--model",
        default="gpt-70b-shape",
        help=f"model shape: {', '.join(MODELS)}; MoE layers: {', '.join(MOE_MODELS)}",
    )
    parser.add_argument("--tp", type=world_size, default=8, help="tensor-parallel size")
    parser.add_argument("--pp", type=world_size, default=8, help="pipeline-parallel size")
    parser.add_argument("--dp", type=world_size, default=64, help="data-parallel size")
    parser.add_argument(
        "--cp",
        type=world_size,
        default=1,
        help="context-parallel size; > 1: the ring attention rows of one cp rank (reference.measure.scale.cp_report)",
    )
    add_flag(
        parser, "--micro-batches", "--microbatches", type=microbatches, default=16, help="micro-batches per step (m)"
    )
    add_flag(parser, "--sequence-parallel", "--sp", action="store_true", help="sequence parallelism")
    parser.add_argument(
        "--schedule",
        choices=ALL_SCHEDULES,
        default="1f1b",
        help="pipeline schedule (zbv, dualpipev: two stages per rank in a V)",
    )
    parser.add_argument(
        "--virtual-stages",
        type=int,
        default=1,
        metavar="V",
        help="model chunks per stage; V > 1: interleaved 1F1B (layers divisible by pp x V, micro-batches by pp)",
    )
    parser.add_argument(
        "--bucket-size",
        type=int,
        default=DEFAULT_BUCKET_SIZE,
        metavar="BYTES",
        help="DDP gradient bucket size (0: one bucket)",
    )
    parser.add_argument(
        "--dp-sharding",
        choices=["replicate", "optimizer", "gradients", "fsdp2"],
        default="replicate",
        help="optimizer: the distributed optimizer shards fp32 masters and Adam states over DP (ZeRO-1), "
        "reduce-scatters the gradients and all-gathers the parameters; needs dp > 1. gradients: ZeRO-2, the same "
        "traffic, and each rank keeps only its shard of the reduced gradients. fsdp2: the reference "
        "FSDP2 shards every TP-local parameter over DP (fp32 shards, bf16 compute); needs --pp 1 and "
        "--micro-batches 1",
    )
    parser.add_argument(
        "--dp-replicate",
        type=int,
        default=1,
        metavar="R",
        help="with --dp-sharding fsdp2: HSDP, the DP group as R replicas, each sharding over dp / R ranks",
    )
    parser.add_argument(  # the old spelling, hidden: one spelling per concept across the CLIs
        "--distributed-optimizer",
        dest="dp_sharding",
        action="store_const",
        const="optimizer",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--order", choices=ORDERS, default="tp-pp-dp", help="rank order (megatron's `order`)")
    parser.add_argument(
        "--rank",
        type=int,
        action="append",
        default=None,
        help="rank to trace (repeatable); default: a first, middle and last stage rank",
    )
    parser.add_argument("--json", action="store_true", help="print the trace document as JSON")
    add_flag(
        parser,
        "--ep",
        "--expert-parallel",
        "--expert-model-parallel-size",
        type=world_size,
        default=1,
        help="expert-parallel size, carved out of DP (MoE models only; with --pp > 1 it needs --order tp-dp-pp)",
    )
    parser.add_argument(
        "--routing-skew",
        type=routing_skew,
        default=0.0,
        metavar="S",
        help="MoE models: expert i gets a share of the routed tokens proportional to (i + 1)^-S (Zipf; 0: uniform)",
    )
    return parser


def format_document(doc: dict) -> str:
    s = doc["setup"]
    lines = [
        f"{s['model']['name']} on tp {s['tp']} x pp {s['pp']} x dp {s['dp']} = {doc['world']} ranks, "
        f"{s['microbatches']} micro-batches, sp {'on' if s['sp'] else 'off'}, {s['schedule']}"
        + (f" interleaved over {s['virtual_stages']} chunks per stage" if s.get("virtual_stages", 1) > 1 else "")
        + _dp_sharding(s),
        _model_line(s["model"], doc["parameters"]),
    ]
    width = max([5] + [len(r["group"]) for run in doc["runs"] for r in run["rows"]])  # HSDP's groups are longer
    for run in doc["runs"]:
        lines.append(f"rank {run['rank']} (pipeline stage {run['stage']} of {s['pp']}): one step")
        lines += rows_table(run["rows"], width, 16)
        lines.append(f"  {'held':{width + 15}} {'':>6} {'bytes':>16} {'':>12}  formula")
        for what, nbytes in run["memory"]["measured"].items():
            expected = run["memory"]["formula"][what]
            verdict = "" if nbytes == expected else f"   MISMATCH: formula gives {expected} B"
            lines.append(
                f"  {what:{width + 15}} {'':>6} {nbytes:>16,} {formulas.human(nbytes):>12}  {expected:,}{verdict}"
            )
        if "pipeline" in run:
            pipe = run["pipeline"]
            peak, expected = pipe["measured"]["peak_in_flight"], pipe["formula"]["peak_in_flight"]
            verdict = "" if peak == expected else f"   MISMATCH: formula gives {expected}"
            chunked = s.get("virtual_stages", 1) > 1 or s["schedule"] in V_SCHEDULES
            lines.append(
                f"  pipeline: {peak} {'chunk-' * chunked}forwards in flight at the peak (formula {expected}){verdict}; "
                f"bubble {pipe['bubble_formula']:.4f} "
                "with uniform stages"
            )
    return "\n".join(lines)


def _model_line(model: dict, parameters: int) -> str:
    """The model's parameter count (the whole model, unsplit) and the block it is built of."""
    if model.get("style") == "llama":
        block = (
            f"Llama block: GQA {model['num_attention_heads']} query / {model['num_kv_heads']} key-value heads, "
            "SwiGLU, RMSNorm, rotary, untied embeddings"
        )
    else:
        block = "reference GPT block: multi-head attention, GELU MLP, LayerNorm, learned positions, untied embeddings"
    return f"{parameters:,} parameters ({parameters / 1e9:.2f} B; {block})"


def _dp_sharding(s: dict) -> str:
    """How the header names the DP side: DDP's buckets, the distributed optimizer, FSDP2 or HSDP."""
    if s.get("fsdp2"):
        replicas = s["dp_replicate"]
        return f", HSDP: {replicas} replicas x {s['dp'] // replicas} shards" if replicas > 1 else ", FSDP2 over dp"
    buckets = f"buckets of {formulas.human(s['bucket_size'])}" if s["bucket_size"] else "in one bucket"
    zero = ", distributed optimizer" * bool(s.get("distributed_optimizer")) + ", gradient shards" * bool(
        s.get("shard_gradients")
    )
    return ", DDP " + buckets + zero


def setup_from(args: argparse.Namespace) -> ScaleSetup:
    """The setup these parsed arguments describe (tools/study/record_traces.py names its traces' arguments; the
    tests trace the same setups in-process). ParallelConfigError for one that cannot exist."""
    return setup_for(
        args.model.lower(),
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        microbatches=args.micro_batches,
        sp=args.sequence_parallel,
        schedule=args.schedule,
        bucket_size=args.bucket_size or None,
        order=args.order,
        distributed_optimizer=args.dp_sharding in ("optimizer", "gradients"),
        shard_gradients=args.dp_sharding == "gradients",
        virtual_stages=args.virtual_stages,
        fsdp2=args.dp_sharding == "fsdp2",
        dp_replicate=args.dp_replicate,
    )


def traced_with_progress(setup: ScaleSetup, ranks: list[int]) -> list[RankStep]:
    """step_of each rank, with a line on stderr before each: a 70B rank takes 15-30 s to trace, and stdout holds
    only the result (one JSON document with --json)."""
    start, steps = time.perf_counter(), []
    for i, rank in enumerate(ranks, 1):
        say(f"tracing rank {rank} (pipeline stage {stage_of(setup, rank)} of {setup.pp}), {i} of {len(ranks)} ...")
        steps.append(step_of(setup, rank))
    say(f"traced {len(ranks)} rank{'s' * (len(ranks) != 1)} in {time.perf_counter() - start:.1f} s")
    return steps


def say(line: str) -> None:
    print(f"reference.measure.scale: {line}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cp = {"cp": args.cp} if args.cp > 1 else {}  # named only when used: the cp 1 refusals read as before
    refuse_large_world(parser, tp=args.tp, **cp, pp=args.pp, dp=args.dp)
    if args.cp > 1:
        return cp_report.run(args)
    moe = args.model.lower() in MOE_MODELS
    if not moe and (args.ep != 1 or args.routing_skew):
        parser.error(f"--ep and --routing-skew need a MoE model: {', '.join(MOE_MODELS)}")
    setup_of, ranks_of, traced, document_of, text_of = (
        moe_report.BRANCH if moe else (setup_from, default_ranks, traced_with_progress, document, format_document)
    )
    try:
        setup = setup_of(args)
        ranks = args.rank or ranks_of(setup)
        outside = [r for r in ranks if not 0 <= r < setup.world]
        if outside:
            raise ParallelConfigError(f"--rank {outside[0]} is outside the world of {setup.world} ranks")
    except ParallelConfigError as error:
        print(f"reference.measure.scale: error: {error}", file=sys.stderr)
        return 2
    doc = document_of(setup, traced(setup, ranks))
    print(json.dumps(doc) if args.json else text_of(doc))
    return 0 if doc["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())

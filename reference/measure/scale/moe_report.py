"""`python -m reference.measure.scale --model mixtral-8x7b --tp 2 --pp 4 --dp 16 --ep 8 --order tp-dp-pp
--routing-skew 0.5`: the MoE branch of the CLI. Traces the MoE layers of an EP rank holding the hottest experts
and of one holding the coldest (reference.measure.scale.moe_simulate), and prints per group and collective type
the bytes of one step beside the closed form, the bytes each rank holds (and would hold without EP), and the
stated routing's imbalance. Exit 0 when every row agrees, 1 when one does not, 2 for a setup that cannot exist.
"""

from __future__ import annotations

import argparse
import sys
import time

from reference.measure.scale import formulas
from reference.measure.scale.moe_shapes import MoESetup, moe_setup_for
from reference.measure.scale.moe_simulate import RankStep, default_ranks, document, step_of
from reference.measure.scale.simulate import rows_table
from reference.parallel_state import ParallelConfigError

NOT_MODELLED = {  # flags of the dense trace the MoE trace refuses away from their defaults
    "dp_sharding": (
        "replicate",
        "--dp-sharding other than replicate (the MoE trace steps every parameter on every rank)",
    ),
    "virtual_stages": (1, "--virtual-stages (the MoE trace runs no pipeline schedule)"),
    "dp_replicate": (1, "--dp-replicate (HSDP shards over DP; the MoE trace replicates)"),
}


def setup_from(args: argparse.Namespace) -> MoESetup:
    """The MoE setup these parsed arguments describe; ParallelConfigError for one that cannot exist or a flag
    the MoE trace does not model."""
    for name, (default, what) in NOT_MODELLED.items():
        if getattr(args, name) != default:
            raise ParallelConfigError(f"{what} is not modelled for MoE models")
    return moe_setup_for(
        args.model.lower(),
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        ep=args.ep,
        microbatches=args.micro_batches,
        routing_skew=args.routing_skew,
        bucket_size=args.bucket_size or None,
        order=args.order,
    )


def format_document(doc: dict) -> str:
    s, r = doc["setup"], doc["routing"]
    sizes = doc["group_sizes"]
    lines = [
        f"{s['model']['name']} MoE layers on tp {s['tp']} x pp {s['pp']} x dp {s['dp']} = {doc['world']} ranks, "
        f"ep {sizes['ep']} x expert dp {sizes['edp']}, {s['microbatches']} micro-batches, DDP "
        + (f"buckets of {formulas.human(s['bucket_size'])}" if s["bucket_size"] else "in one bucket"),
        f"routing: Zipf skew {r['skew']}, {r['tokens']} tokens x top-{r['topk']} = {r['pairs']} pairs per rank per "
        f"layer and micro-batch; per expert max {r['expert_max']} / mean {r['expert_mean']:g} = "
        f"{r['expert_max_over_mean']:.2f}; busiest EP rank receives {max(r['ep_rank_received'])} / mean "
        f"{r['ep_rank_mean']} = {r['busiest_ep_rank_over_mean']:.2f}",
    ]
    for run in doc["runs"]:
        lines.append(f"rank {run['rank']}, {run['label']}, pipeline stage {run['stage']} of {s['pp']}: one step")
        lines += rows_table(run["rows"], 5, 18)
        memory = run["memory"]
        lines.append(f"  {'held':20} {'bytes':>18} {'':>12}  formula, and without EP")
        for what, nbytes in memory["measured"].items():
            expected = memory["formula"][what]
            verdict = "" if nbytes == expected else f"   MISMATCH: formula gives {expected} B"
            lines.append(
                f"  {what:20} {nbytes:>18,} {formulas.human(nbytes):>12}  {expected:,}, "
                f"{formulas.human(memory['without_ep'][what])} at ep 1{verdict}"
            )
    return "\n".join(lines)


def traced_with_progress(setup: MoESetup, ranks: list[int]) -> list[RankStep]:
    start, steps = time.perf_counter(), []
    for i, rank in enumerate(ranks, 1):
        print(f"reference.measure.scale: tracing rank {rank}, {i} of {len(ranks)} ...", file=sys.stderr, flush=True)
        steps.append(step_of(setup, rank))
    print(f"reference.measure.scale: traced in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return steps


BRANCH = (setup_from, default_ranks, traced_with_progress, document, format_document)  # what __main__ runs for MoE

"""`torchrun --nproc-per-node N -m reference --fsdp`: train the small GPT with FSDP for a few steps.

The model is reference.gpt.model.GPT: each layer is one unit and the root (embedding, final LayerNorm, output
layer, loss) another, wrapped children-first as with FSDP1; `--use-torch-fsdp` swaps in PyTorch's FSDP1 with
the same options. Each step prints its loss, traffic and per-rank parameter memory; the last also its compute
and collectives in issue order, all-gathers that another unit prefetched marked, so the prefetch flags show
where they move them. `--json` prints one object per rank and step (the recorder's events and spans, and that
`issue_order`); `--trace DIR` writes the last step's to DIR/fsdp_trace.rank<r>.json for the timeline diagram."""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from reference.distributed import OPTIMIZERS, LaunchError, distributed, pick_dtype
from reference.fsdp.units import shard_model, sharded_parameter_bytes
from reference.gpt.model import GPT, GPTConfig
from reference.gpt.train import split_batch, synthetic_batches
from reference.measure.fsdp_tracing import issue_order, unit_scopes
from reference.measure.recorder import CollectiveRecorder

PREFETCH_CHOICES = {"pre": "BACKWARD_PRE", "post": "BACKWARD_POST", "none": None}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--backward-prefetch",
        choices=sorted(PREFETCH_CHOICES),
        default="pre",
        help="all-gather the next unit in backward before (pre) or after (post) the current "
        "unit's gradient computation, or only when needed (none)",
    )
    group.add_argument(
        "--forward-prefetch",
        action="store_true",
        help="all-gather unit l+1 before unit l computes (from the second step on)",
    )
    group.add_argument(
        "--mixed-precision",
        action="store_true",
        help="bf16 parameters and compute, fp32 gradient reduction and fp32 shards: what --dtype bf16 "
        "(and auto on CUDA) gives this demo",
    )
    group.add_argument("--cpu-offload", action="store_true", help="keep the shards on the CPU between uses")
    group.add_argument(
        "--use-torch-fsdp",
        action="store_true",
        help="use torch.distributed.fsdp.FullyShardedDataParallel instead of the reference",
    )


def run(args: argparse.Namespace) -> None:
    try:
        config = GPTConfig(
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            num_layers=args.num_layers,
            seq_length=args.seq_length,
        )
    except ValueError as error:
        sys.exit(f"reference: error: {error}")
    try:
        with distributed(args.device, timeout_s=60) as device:
            _train(args, config, device)
    except LaunchError as error:
        sys.exit(f"reference: error: {error}")


def _train(args: argparse.Namespace, config: GPTConfig, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mixed = args.mixed_precision or pick_dtype(args.dtype, device) == torch.bfloat16
    model = GPT(config, args.seed, device)
    total_bytes = sharded_parameter_bytes(model)
    model = shard_model(
        model,
        "fsdp1" if args.use_torch_fsdp else "reference",
        dist.group.WORLD,
        backward_prefetch=PREFETCH_CHOICES[args.backward_prefetch],
        forward_prefetch=args.forward_prefetch,
        param_dtype=torch.bfloat16 if mixed else None,
        reduce_dtype=torch.float32 if mixed else None,
        cpu_offload=args.cpu_offload,
    )
    optimizer = OPTIMIZERS[args.optimizer](model.parameters(), lr=args.lr)
    shard_bytes = sharded_parameter_bytes(model)
    with CollectiveRecorder() as recorder, unit_scopes(model) as prefetches:
        # Each rank trains on --micro-batch-size samples of a global batch of that times the world size.
        batches = synthetic_batches(config, args.steps, args.batch_size * world, args.seed)
        for step, tokens in enumerate(batches):
            recorder.clear()
            ((inputs, labels),) = split_batch(tokens.to(device), world, rank, 1)
            loss = model(inputs, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            last = step == args.steps - 1
            record = {
                "step": step,
                "dtype": "bf16" if mixed else "fp32",
                "loss": loss.item(),
                "param_bytes_per_rank": shard_bytes,
                "param_bytes_unsharded": total_bytes,
                **recorder.to_dict(),
                **({"issue_order": issue_order(recorder, prefetches)} if args.json or last else {}),
            }  # the text output lists the issue order of the last step only
            _report(args, record, last=last)
        trace_dir = args.trace
        if trace_dir is not None:
            trace_dir.mkdir(parents=True, exist_ok=True)
            (trace_dir / f"fsdp_trace.rank{rank}.json").write_text(json.dumps(record))


def _report(args, record: dict, last: bool) -> None:
    """Rank 0 prints; with --json it gathers every rank's record first (after this step's recording)."""
    if args.json:
        records = [None] * dist.get_world_size() if record["rank"] == 0 else None
        dist.gather_object(record, records)
        for each in records or []:
            print(json.dumps(each), flush=True)
        return
    if record["rank"] != 0:
        return
    shard, total = record["param_bytes_per_rank"], record["param_bytes_unsharded"]
    lines = [
        f"step {record['step']}  loss {record['loss']:.4f} ({record['dtype']})  parameters on this rank {shard} B "
        f"(unsharded {total} B, ratio {shard / total:.3f})"
    ]
    if last and record["issue_order"]:  # empty where the recorder is off
        lines += [
            "  compute and collectives in the order rank 0 issued them (a unit computes until the next line, the",
            "  root around the layers until its 'compute ends'; prefetch: issued early, from another unit's hook):",
        ]
        lines += [f"  {e['phase']:8} {_issued(e)}" for e in record["issue_order"]]
    summary = ", ".join(f"{op} x{v['count']} {v['bytes']} B" for op, v in record["summary"].items())
    print("\n".join(lines + [f"  total: {summary or 'none recorded'}"]), flush=True)


def _issued(entry: dict) -> str:
    """One line of the issue order: a unit's compute (which runs until the next line, or, for a unit around
    others, until its "compute ends" line) or a collective, marked when another unit prefetched it."""
    if entry["op"] in ("compute", "compute ends"):
        return f"{entry['op']:14} {entry['unit']}"
    early = "  prefetch" if entry["prefetch"] else ""
    return f"{entry['op']:14} {entry['unit'] or '?':10} {entry['nbytes']:>9} B  {entry['dtype']}{early}"

"""`torchrun --nproc-per-node N -m reference --fsdp [--fsdp-version 2]`: train the small GPT with FSDP a few steps.

The model is reference.gpt.model.GPT: each layer is one unit and the root (embedding, final LayerNorm, output
layer, loss) another, sharded children-first; FSDP1's flat parameters (reference.fsdp), or with
`--fsdp-version 2` per-parameter `fully_shard` (reference.fsdp2); `--use-torch-fsdp` swaps in PyTorch's own,
same options. Each step prints its loss, traffic and per-rank parameter memory; the last also its compute and
collectives in issue order, prefetched all-gathers marked. `--json` prints one object per rank and step (the
recorder's events and spans, and that `issue_order`); `--trace DIR` writes the last step's to
DIR/fsdp_trace.rank<r>.json for the timeline diagram."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from reference.arguments import refuse_large_memory
from reference.distributed import OPTIMIZERS, LaunchError, distributed, one_line_errors, pick_dtype
from reference.fsdp.units import padded_shard_bytes, shard_model, sharded_parameter_bytes
from reference.gpt.arguments import memory_per_rank
from reference.gpt.model import GPT, GPTConfig
from reference.gpt.train import split_batch, synthetic_batches
from reference.measure.fsdp_tracing import issue_order, unit_scopes
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import ParallelConfigError

PREFETCH_CHOICES = {"pre": "BACKWARD_PRE", "post": "BACKWARD_POST", "none": None}
IMPLEMENTATIONS = {(1, False): "reference", (1, True): "fsdp1", (2, False): "reference-fsdp2", (2, True): "fsdp2"}


def reshard_after_forward(text: str) -> bool | int:
    """`true`, `false`, or a group size (a whole number >= 1): FSDP2's `reshard_after_forward`."""
    if text in ("true", "false"):
        return text == "true"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected true, false or a group size >= 1, got {text!r}")
    return value


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
        help="all-gather unit l+1 before unit l computes (FSDP1: from the second step on, once the order is "
        "recorded; FSDP2: explicitly, set_modules_to_forward_prefetch, from the first)",
    )
    group.add_argument(
        "--mixed-precision",
        action="store_true",
        help="bf16 parameters and compute, fp32 gradient reduction and fp32 shards: what --dtype bf16 "
        "(and auto on CUDA) gives this demo",
    )
    group.add_argument(
        "--cpu-offload", action="store_true", help="keep the shards on the CPU between uses (FSDP1, or torch's FSDP2)"
    )
    group.add_argument(
        "--fsdp-version",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: flat parameters, one per unit (reference.fsdp); 2: per-parameter fully_shard (reference.fsdp2), "
        "which prefetches in backward implicitly (--backward-prefetch pre) and in forward only explicitly "
        "(--forward-prefetch: each unit the next)",
    )
    group.add_argument(
        "--reshard-after-forward",
        type=reshard_after_forward,
        default=None,
        metavar="true|false|N",
        help="FSDP2: free the unsharded parameters after forward (true), keep them for backward (false), or keep "
        "a shard over N ranks (a divisor of the shard group); default: true, except false for the root",
    )
    group.add_argument(
        "--dp-replicate",
        type=int,
        default=1,
        metavar="R",
        help="FSDP2: HSDP, R replicas of a shard group of N / R consecutive ranks (gradients reduce-scattered in "
        "the shard group, then all-reduced across the replicas)",
    )
    group.add_argument(
        "--use-torch-fsdp",
        action="store_true",
        help="use PyTorch's FSDP instead of the reference: FullyShardedDataParallel, or fully_shard with "
        "--fsdp-version 2",
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
    with one_line_errors("reference"):  # a refused FSDP2 option or size: one line, exit 2
        _check_version_options(args)
        shards = int(os.environ.get("WORLD_SIZE", "1"))
        if why := refuse_large_memory("this model", memory_per_rank(config, args, split=1, shards=shards, in_flight=1)):
            raise ParallelConfigError(why)
        try:
            with distributed(args.device, timeout_s=60) as device:
                _train(args, config, device)
        except LaunchError as error:
            sys.exit(f"reference: error: {error}")


def _check_version_options(args: argparse.Namespace) -> None:
    """Each option belongs to FSDP1 or FSDP2; refuse one given to the other before anything starts."""
    if args.fsdp_version == 1:
        fsdp2_only = {
            "--reshard-after-forward": args.reshard_after_forward is not None,
            "--dp-replicate": args.dp_replicate != 1,
        }
        for flag, given in fsdp2_only.items():
            if given:
                raise ParallelConfigError(f"{flag} is FSDP2's; add --fsdp-version 2")
        return
    if args.backward_prefetch != "pre":
        raise ParallelConfigError(
            f"--backward-prefetch {args.backward_prefetch}: FSDP2 prefetches in backward from the pre-backward "
            "hook only (pre); post and none are FSDP1's"
        )
    if args.cpu_offload and not args.use_torch_fsdp:
        raise ParallelConfigError("--cpu-offload: the reference FSDP2 keeps its shards on the compute device")
    if args.dp_replicate < 1:
        raise ParallelConfigError(f"--dp-replicate {args.dp_replicate}: expected a replica count >= 1")


def _check_mesh(args: argparse.Namespace, world: int) -> None:
    """The HSDP grid and the post-forward group size must divide what they split (same answer on every rank)."""
    if world % args.dp_replicate:
        raise ParallelConfigError(f"--dp-replicate {args.dp_replicate} does not divide the {world} ranks")
    shards, size = world // args.dp_replicate, args.reshard_after_forward
    if isinstance(size, int) and not isinstance(size, bool) and shards % size:
        raise ParallelConfigError(
            f"--reshard-after-forward {size} does not divide the shard group's {shards} ranks (world / --dp-replicate)"
        )


def _train(args: argparse.Namespace, config: GPTConfig, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    _check_mesh(args, world)
    mixed = args.mixed_precision or pick_dtype(args.dtype, device) == torch.bfloat16
    model = GPT(config, args.seed, device)
    total_bytes = sharded_parameter_bytes(model)
    fsdp2 = {"reshard_after_forward": args.reshard_after_forward, "replicas": args.dp_replicate}
    model = shard_model(
        model,
        IMPLEMENTATIONS[args.fsdp_version, args.use_torch_fsdp],
        dist.group.WORLD,
        backward_prefetch=PREFETCH_CHOICES[args.backward_prefetch],
        forward_prefetch=args.forward_prefetch,
        param_dtype=torch.bfloat16 if mixed else None,
        reduce_dtype=torch.float32 if mixed else None,
        cpu_offload=args.cpu_offload,
        **(fsdp2 if args.fsdp_version == 2 else {}),
    )
    optimizer = OPTIMIZERS[args.optimizer](model.parameters(), lr=args.lr)
    shard_bytes = (padded_shard_bytes if args.fsdp_version == 2 else sharded_parameter_bytes)(model)
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

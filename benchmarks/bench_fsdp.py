"""Reference FSDP vs PyTorch FSDP1 and FSDP2: step time, prefetch overlap, per-rank parameter memory.

    torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py [--hidden-size 256 --num-layers 6 ...]

All configurations run in one process group, interleaved round by round so machine noise hits them alike.
Per configuration: the fastest step (forward + backward + SGD step; the minimum over steps resists other
load on a shared machine, then the maximum over ranks), and how much of the communication is hidden under
compute:

    exposed = step time - compute time (the same local batch through the unsharded model, no collectives)
    hidden  = 1 - exposed / communication time (this step's all-gathers and reduce-scatters run alone)

Per-rank parameter bytes are the shards each rank keeps between steps, against the unsharded model; on CUDA
the peak allocated memory of each configuration is printed too. Ratios are against FSDP2 (target: within
10% of its step time) and against FSDP1 with the same options. Communicated bytes per step are recorded by
`CollectiveRecorder` in one extra step per configuration.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist
from _harness import add_sizes

from reference.arguments import add_flag, steps
from reference.distributed import all_gather_single, distributed, reduce_scatter_single
from reference.fsdp.units import shard_model, sharded_parameter_bytes
from reference.gpt.model import GPT, GPTConfig
from reference.gpt.train import split_batch, synthetic_batches
from reference.measure.recorder import CollectiveRecorder

CONFIGS = [  # (label, implementation, backward_prefetch, forward_prefetch)
    ("reference none", "reference", None, False),
    ("reference pre", "reference", "BACKWARD_PRE", False),
    ("reference post", "reference", "BACKWARD_POST", False),
    ("reference pre+fwd", "reference", "BACKWARD_PRE", True),
    ("fsdp1 none", "fsdp1", None, False),
    ("fsdp1 pre", "fsdp1", "BACKWARD_PRE", False),
    ("fsdp1 post", "fsdp1", "BACKWARD_POST", False),
    ("fsdp1 pre+fwd", "fsdp1", "BACKWARD_PRE", True),
    ("fsdp2", "fsdp2", None, False),
]


def build_parser(doc: str = __doc__, per: str = "configuration") -> argparse.ArgumentParser:
    """The flags bench_fsdp and bench_fsdp2 share: the GPT's sizes (its vocabulary fixed), the batch, the timing."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_sizes(parser, hidden_size=128, num_attention_heads=8, num_layers=4, seq_length=64)
    add_flag(
        parser, "--global-batch-size", "--batch-size", dest="batch_size", type=int, default=8, help="split over ranks"
    )
    parser.add_argument("--steps", type=steps, default=6, help=f"timed steps per {per} per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.set_defaults(vocab_size=1024)  # for GPTConfig.from_sizes
    return parser


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def timed_steps(model, optimizer, batches, device) -> list[float]:
    times = []
    for inputs, labels in batches:
        inputs, labels = inputs.to(device), labels.to(device)
        dist.barrier()
        start = time.perf_counter()
        model(inputs, labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def communication_time(events, device, repeats: int = 9) -> float:
    """Run one step's recorded collectives back to back, nothing else: fastest seconds per step."""
    world = dist.get_world_size()
    buffers = [
        (
            e.op,
            torch.empty(e.nbytes // world, dtype=torch.uint8, device=device),
            torch.empty(e.nbytes, dtype=torch.uint8, device=device),
        )
        for e in events
    ]
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for op, shard, full in buffers:
            if op == "all_gather":
                all_gather_single(full, shard)
            else:  # reduce-scatter of a float buffer the same size
                reduce_scatter_single(shard.view(torch.float32), full.view(torch.float32))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    args = build_parser().parse_args()
    with distributed() as device:
        _benchmark(args, device)


def _benchmark(args, device: torch.device) -> None:
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig.from_sizes(args)
    initial = GPT(config, 0, device)
    batches = [split_batch(t, world, rank, 1)[0] for t in synthetic_batches(config, args.steps, args.batch_size, 0)]
    unsharded_bytes = sharded_parameter_bytes(initial)  # before sharding: every parameter, whole

    models = {"compute only": (copy.deepcopy(initial), None)}
    for label, implementation, backward, forward in CONFIGS:
        models[label] = (
            shard_model(
                copy.deepcopy(initial),
                implementation,
                dist.group.WORLD,
                backward_prefetch=backward,
                forward_prefetch=forward,
            ),
            implementation,
        )
    optimizers = {label: torch.optim.SGD(model.parameters(), lr=1e-3) for label, (model, _) in models.items()}
    times: dict[str, list[float]] = {label: [] for label in models}
    peaks: dict[str, int] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up (and records the forward order)
        for label, (model, _) in models.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            step_times = timed_steps(model, optimizers[label], batches, device)
            if round_:
                times[label] += step_times
            if cuda:
                peaks[label] = torch.cuda.max_memory_allocated()

    compute = max_over_ranks(min(times["compute only"]))
    rows = []
    comm_times: dict[tuple, float] = {}  # the same collectives (same bytes) are timed once
    with CollectiveRecorder() as recorder:
        for label, (model, implementation) in models.items():
            if implementation is None:
                continue
            recorder.clear()
            timed_steps(model, optimizers[label], batches[:1], device)
            events = [e for e in recorder.events if e.op in ("all_gather", "reduce_scatter")]
            step = max_over_ranks(min(times[label]))
            signature = tuple(sorted((e.op, e.nbytes) for e in events))
            if signature not in comm_times:
                comm_times[signature] = max_over_ranks(communication_time(events, device))
            comm = comm_times[signature]
            hidden = min(1.0, max(0.0, 1 - (step - compute) / comm))
            param_bytes = (
                sum(_local_bytes(p) for p in model.parameters())
                if implementation == "fsdp2"
                else _flat_shard_bytes(model, implementation)
            )
            rows.append((label, step, comm, hidden, sum(e.nbytes for e in events), param_bytes, peaks.get(label)))
        if rank == 0:
            _print_table(args, world, device, compute, unsharded_bytes, rows)


def _local_bytes(param) -> int:
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel() * local.element_size()


def _flat_shard_bytes(model, implementation: str) -> int:
    if implementation == "reference":
        return sum(h.sharded_param_bytes() for h in model.handles())
    from torch.distributed.fsdp import FullyShardedDataParallel

    return sum(
        m._handle.flat_param._local_shard.numel() * m._handle.flat_param._local_shard.element_size()
        for m in model.modules()
        if isinstance(m, FullyShardedDataParallel) and m._handle
    )


def _print_table(args, world, device, compute, unsharded_bytes, rows) -> None:
    by_label = {row[0]: row for row in rows}
    print(
        f"world {world} on {device.type}; model h={args.hidden_size} layers={args.num_layers} "
        f"s={args.seq_length} global batch {args.batch_size}; {args.rounds}x{args.steps} timed steps"
    )
    print(
        f"compute only (unsharded, local batch): {compute * 1e3:.1f} ms/step (fastest); unsharded parameters "
        f"{unsharded_bytes / 2**20:.2f} MiB"
    )
    header = (
        f"{'config':18} {'step ms':>8} {'comm ms':>8} {'hidden':>7} {'comm MiB':>9} {'params/rank':>12} "
        f"{'vs fsdp2':>9} {'vs fsdp1':>9}"
    )
    print(header + ("  peak MiB" if device.type == "cuda" else ""))
    for label, step, comm, hidden, nbytes, param_bytes, peak in rows:
        fsdp1 = by_label.get(label.replace("reference", "fsdp1"))
        vs_fsdp1 = f"{step / fsdp1[1]:9.2f}" if fsdp1 else f"{'-':>9}"
        line = (
            f"{label:18} {step * 1e3:8.1f} {comm * 1e3:8.1f} {hidden:7.0%} {nbytes / 2**20:9.2f} "
            f"{param_bytes / unsharded_bytes:11.3f}x {step / by_label['fsdp2'][1]:9.2f} {vs_fsdp1}"
        )
        print(line + (f"  {peak / 2**20:8.1f}" if peak else ""))


if __name__ == "__main__":
    main()

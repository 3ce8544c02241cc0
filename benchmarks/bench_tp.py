"""Forward+backward time per step of the TP transformer: reference vs megatron-core vs DTensor, one run.

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py [--hidden-size 512 --seq-length 128 ...]

All three run the same model at the same shapes on the same ranks, interleaved step by step so that
machine noise hits them alike; the medians and ratios are printed by rank 0.
  * reference: the GPT's blocks (reference.gpt.model.gpt_blocks) split by parallelize; also "ref-sync" (flag
               async_grad_allreduce off: no overlap of the dX collective with the dW GEMM) and "ref-fusion"
               (gradient_accumulation_fusion on: dW accumulated into main_grad), to show each flag's effect
  * megatron:  the same block with its four linear layers swapped for megatron-core 0.16.1's
               ColumnParallelLinear / RowParallelLinear (same arguments, same (output, bias) convention),
               so the comparison isolates the parallel linear layers and their communication
  * dtensor:   the same blocks parallelized with DTensor's ColwiseParallel /
               RowwiseParallel (and SequenceParallel for LayerNorm with --sequence-parallel)
Then one recorded step per implementation gives the bytes communicated per step, against the formula.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
import torch.distributed as dist

from reference.measure.torch_patches import cuda_calls_on_cpu

if not torch.cuda.is_available():  # megatron allocates some buffers on torch.cuda.current_device()
    cuda_calls_on_cpu()

from _harness import add_sizes, interleaved_times, recorded_traffic
from megatron.core import parallel_state as mpu
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear as MegatronColumn
from megatron.core.tensor_parallel import RowParallelLinear as MegatronRow
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from reference.distributed import distributed
from reference.gpt.model import GPT, gpt_blocks
from reference.parallel_state import build_layout
from reference.tensor_parallel.parallelize import parallelize
from reference.tensor_parallel.transformer import init_method_normal


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sizes(parser, batch_size=4, seq_length=128, hidden_size=512, num_attention_heads=8, num_layers=2)
    parser.add_argument(
        "--rounds", type=int, default=30, help="rounds; each times one step of every implementation, in turn"
    )
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return parser.parse_args()


def megatron_swap(model: GPT, args, device) -> GPT:
    """Replace every reference linear layer by megatron-core's, built the same way (same seed order); each
    returns its output alone (bias added), as the nn.Linear the block is written for."""
    config = ModelParallelConfig(
        tensor_model_parallel_size=dist.get_world_size(),
        sequence_parallel=args.sequence_parallel,
        use_cpu_initialization=True,
    )
    for block in model.layers:
        for parent, name in (
            (block.attention, "qkv"),
            (block.attention, "proj"),
            (block.mlp, "fc1"),
            (block.mlp, "fc2"),
        ):
            old = getattr(parent, name)
            common = dict(
                config=config,
                init_method=init_method_normal(),
                bias=True,
                skip_bias_add=False,  # add the bias inside, as nn.Linear does (megatron's Row requires saying so)
                tp_group=mpu.get_tensor_model_parallel_group(),
            )
            if name in ("qkv", "fc1"):
                new = MegatronColumn(old.input_size, old.output_size, gather_output=False, **common)
            else:
                new = MegatronRow(old.input_size, old.output_size, input_is_parallel=True, **common)
            new.register_forward_hook(lambda _module, _args, output: output[0])
            setattr(parent, name, new.to(device))
    return model


def dtensor_model(args, mesh, device):
    model = gpt_blocks(args.num_layers, args.hidden_size, args.num_attention_heads, device=device)
    sp = args.sequence_parallel
    plan = {
        "attention.qkv": ColwiseParallel(input_layouts=Shard(0) if sp else Replicate()),
        "attention.proj": RowwiseParallel(output_layouts=Shard(0) if sp else Replicate()),
        "mlp.fc1": ColwiseParallel(input_layouts=Shard(0) if sp else Replicate()),
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(0) if sp else Replicate()),
    }
    if sp:
        plan.update({"ln1": SequenceParallel(sequence_dim=0), "ln2": SequenceParallel(sequence_dim=0)})
    for block in model.layers:
        parallelize_module(block, mesh, plan)
    if not sp:
        return model

    def forward(tokens, labels, hidden):  # enter and leave the sequence-parallel region as the reference does
        local = DTensor.from_local(hidden, mesh, [Replicate()]).redistribute(mesh, [Shard(0)]).to_local()
        return DTensor.from_local(GPT.forward(model, None, None, hidden=local), mesh, [Shard(0)]).full_tensor()

    model.forward = forward
    return model


def step(model, x):
    model(None, None, hidden=x).square().mean().backward()


def main():
    args = parse_args()
    with distributed() as device:
        mpu.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
        _benchmark(args, device)
        mpu.destroy_model_parallel()


def _benchmark(args, device: torch.device) -> None:
    cuda = device.type == "cuda"
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = build_layout(world)
    mesh = init_device_mesh(device.type, (world,))
    shape = (args.num_layers, args.hidden_size, args.num_attention_heads)
    models = {}
    for variant, flags in (
        ("reference", {}),
        ("ref-sync", dict(async_grad_allreduce=False)),
        ("ref-fusion", dict(gradient_accumulation_fusion=True)),
        ("megatron", {}),  # its linear layers swapped below, right after it is built
    ):
        torch.manual_seed(0)
        blocks = gpt_blocks(*shape, device=device)
        models[variant] = parallelize(blocks, layout, sequence_parallel=args.sequence_parallel, **flags)
    models["megatron"] = megatron_swap(models["megatron"], args, device)
    torch.manual_seed(0)
    models["dtensor"] = dtensor_model(args, mesh, device)
    x = torch.randn(args.seq_length, args.batch_size, args.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(device)

    steps = {name: functools.partial(step, model, x) for name, model in models.items()}
    for warm_up in steps.values():
        warm_up()
    times = interleaved_times(steps, args.rounds, cuda)
    traffic = recorded_traffic(steps)
    if rank != 0:
        return
    n = args.batch_size * args.seq_length * args.hidden_size * x.element_size()
    layers = args.num_layers
    median = {name: statistics.median(t) for name, t in times.items()}
    best = {name: min(t) for name, t in times.items()}  # the least disturbed step: steadier on a busy machine
    sent = {name: sum(v["bytes"] for v in summary.values()) for name, summary in traffic.items()}
    if args.sequence_parallel:
        formula_n = 10 * layers + 1
        expected = (
            f"per layer 2 all-gather + 2 reduce-scatter forward, 4 all-gather + 2 reduce-scatter backward, "
            f"each N; plus the entry/exit gather: {formula_n}N = {formula_n * n} B"
        )
    else:
        formula_n = 4 * layers
        expected = f"4 all-reduces of N per layer (2 forward, 2 backward): {formula_n}N = {formula_n * n} B"
    if args.json:
        report = {
            "tp": world,
            "device": device.type,
            "sequence_parallel": args.sequence_parallel,
            "median_ms": {name: t * 1e3 for name, t in median.items()},
            "bytes_per_step": sent,
            "formula_bytes": formula_n * n,
            "ratios": {
                f"time reference/{other}": median["reference"] / median[other] for other in ("megatron", "dtensor")
            },
        }
        print(json.dumps(report))
        return
    print(
        f"TP={world} on {device.type} ({'nccl' if cuda else 'gloo'}), b={args.batch_size} s={args.seq_length} "
        f"h={args.hidden_size} heads={args.num_attention_heads} layers={args.num_layers} "
        f"sequence_parallel={args.sequence_parallel}; median of {args.rounds} interleaved steps each"
    )
    for name in models:
        print(f"  {name:10s} fwd+bwd {median[name] * 1e3:8.2f} ms/step  (min {min(times[name]) * 1e3:.2f})")
    for label, stat in (("median", median), ("min", best)):
        print(
            f"  by {label:6s}: reference / megatron = {stat['reference'] / stat['megatron']:.3f}   "
            f"reference / dtensor = {stat['reference'] / stat['dtensor']:.3f}"
        )
    print(f"  bytes per step, N = b*s*h*{x.element_size()} = {n} B; formula: {expected}")
    for name, summary in traffic.items():
        ops = ", ".join(f"{op} x{v['count']}" for op, v in summary.items())
        print(f"  {name:10s} {sent[name]:10d} B  ({ops})")


if __name__ == "__main__":
    main()

"""Forward+backward time per step of one MoE layer at EP = world: reference vs megatron-core, one run.

    torchrun --nproc-per-node 2 benchmarks/bench_moe.py [--hidden-size 256 --num-experts 8 ...] [--json]

Both layers hold the same weights (megatron's, copied into the reference) and run the same input on the same
ranks, interleaved step by step so that machine noise hits them alike; rank 0 prints the medians and the ratio.
  * reference: reference.moe.layer.MoELayer split by parallelize_moe: the all-to-all dispatcher (counts, then
               tokens, and back), SequentialMLP experts
  * megatron:  megatron-core 0.16.1's MoELayer with SequentialMLP experts (get_mlp_module_spec(use_te=False)) and
               its default AllGather dispatcher: every rank gathers every token, computes its experts' share and
               reduce-scatters. Its AlltoAll dispatcher keeps its split sizes on the GPU and does not run on CPU;
               on CUDA it is timed too ("megatron-a2a").
Then one recorded step per implementation gives the bytes each sends per step, by collective.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
import torch.distributed as dist

from reference.measure.torch_patches import cuda_calls_on_cpu

if not torch.cuda.is_available():  # megatron's router moves its weight to torch.cuda.current_device()
    cuda_calls_on_cpu()

from _harness import add_sizes, interleaved_times, recorded_traffic
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

from reference.distributed import distributed
from reference.moe.layer import MoELayer
from reference.moe.parallelize import parallelize_moe

if not hasattr(moe_utils, "te_general_gemm"):  # bound only when Transformer Engine imports, read regardless
    moe_utils.te_general_gemm = None


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sizes(parser, batch_size=4, seq_length=128, hidden_size=256, ffn_hidden_size=512, num_experts=8)
    parser.add_argument("--moe-router-topk", type=int, default=2, help="experts per token k")
    parser.add_argument(
        "--moe-expert-capacity-factor", type=float, default=None, help="capacity factor; default: dropless"
    )
    parser.add_argument(
        "--rounds", type=int, default=20, help="rounds; each times one step of every implementation, in turn"
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return parser.parse_args()


def megatron_layer(args, dispatcher: str, device) -> MegatronMoELayer:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden_size,
        num_attention_heads=1,
        ffn_hidden_size=args.ffn_hidden_size,
        moe_ffn_hidden_size=args.ffn_hidden_size,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=dist.get_world_size(),
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    spec = get_mlp_module_spec(use_te=False, num_experts=args.num_experts, moe_grouped_gemm=False)
    return MegatronMoELayer(config, spec.submodules).to(device)


def reference_layer(args, like: MegatronMoELayer, device) -> MoELayer:
    """The reference layer at EP = world holding `like`'s weights."""
    layer = MoELayer(
        args.hidden_size,
        args.ffn_hidden_size,
        args.num_experts,
        args.moe_router_topk,
        capacity_factor=args.moe_expert_capacity_factor,
        device=device,
    )
    layer = parallelize_moe(layer, mpu.get_expert_model_parallel_group())
    with torch.no_grad():
        layer.router.weight.copy_(like.router.weight)
        for ours, theirs in zip(layer.experts.local_experts, like.experts.local_experts):
            ours.fc1.weight.copy_(theirs.linear_fc1.weight)
            ours.fc2.weight.copy_(theirs.linear_fc2.weight)
    return layer


def step(layer, x):
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out  # megatron returns (output, bias)
    out.square().mean().backward()


def main():
    args = parse_args()
    with distributed() as device:
        mpu.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
        _benchmark(args, device)
        mpu.destroy_model_parallel()


def _benchmark(args, device: torch.device) -> None:
    cuda = device.type == "cuda"
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    layers = {"megatron": megatron_layer(args, "allgather", device)}
    layers = {"reference": reference_layer(args, layers["megatron"], device), **layers}
    if cuda:
        torch.manual_seed(0)
        layers["megatron-a2a"] = megatron_layer(args, "alltoall", device)
    shape = (args.seq_length, args.batch_size, args.hidden_size)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1 + rank)).to(device)  # each rank its tokens
    x.requires_grad_()  # as a layer's input is: the input gradient flows back through the dispatch

    steps = {name: functools.partial(step, layer, x) for name, layer in layers.items()}
    for warm_up in steps.values():
        warm_up()
    times = interleaved_times(steps, args.rounds, cuda)
    traffic = recorded_traffic(steps)
    if rank != 0:
        return
    median = {name: statistics.median(t) for name, t in times.items()}
    sent = {name: sum(v["bytes"] for v in summary.values()) for name, summary in traffic.items()}
    mode = (
        "dropless" if args.moe_expert_capacity_factor is None else f"capacity factor {args.moe_expert_capacity_factor}"
    )
    if args.json:
        report = {
            "ep": world,
            "device": device.type,
            "mode": mode,
            "median_ms": {name: t * 1e3 for name, t in median.items()},
            "bytes_per_step": sent,
            "ops": {name: {op: v["count"] for op, v in summary.items()} for name, summary in traffic.items()},
            "ratios": {"time reference/megatron": median["reference"] / median["megatron"]},
        }
        print(json.dumps(report))
        return
    print(
        f"EP={world} on {device.type} ({'nccl' if cuda else 'gloo'}), b={args.batch_size} s={args.seq_length} "
        f"h={args.hidden_size} ffn={args.ffn_hidden_size} experts={args.num_experts} "
        f"top-{args.moe_router_topk}, {mode}; "
        f"median of {args.rounds} interleaved steps each"
    )
    for name in layers:
        print(f"  {name:12s} fwd+bwd {median[name] * 1e3:8.2f} ms/step  (min {min(times[name]) * 1e3:.2f})")
    print(f"  reference / megatron = {median['reference'] / median['megatron']:.3f} (median)")
    print("  bytes per step on rank 0:")
    for name, summary in traffic.items():
        ops = ", ".join(f"{op} x{v['count']}" for op, v in summary.items())
        print(f"  {name:12s} {sent[name]:10d} B  ({ops})")


if __name__ == "__main__":
    main()

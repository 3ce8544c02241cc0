"""Causal ring attention, forward + backward: the reference's against torch's `_templated_ring_attention`.

    torchrun --nproc-per-node 2 benchmarks/bench_ring_attention.py [--seq-length 1024 ...] [--json]
    torchrun --nproc-per-node 2 benchmarks/bench_ring_attention.py --rotate alltoall   # torch's other rotater

Every rank of the world is one cp rank and holds its head-tail ("zig-zag") balanced shard of q, k, v:
chunks r and 2 cp - 1 - r of 2 cp (reference.context_parallel.load_balance.shard), the layout torch's
`_cp_options.enable_load_balance` expects. Both compute the same attention of the same tensors, interleaved
round by round so that machine noise hits them alike (benchmarks/_harness.py):
  * reference: reference.context_parallel.ring_attention, an autograd Function passing K/V by
               batch_isend_irecv and merging its blocks by log-sum-exp in fp32, each block (query chunk
               against key chunk) by the CPU flash-attention kernel, elsewhere by hand
               (reference.context_parallel.blocks);
  * torch:     `_templated_ring_attention` and `_templated_ring_attention_backward`, with the CPU
               flash-attention kernels per step (benchmarks/_torch_ring.py; on CUDA its ring flash
               wrappers), K/V rotated by torch's rotater (--rotate: allgather, its default, or alltoall).
The median and fastest step of each are printed by rank 0, and their ratio reference / torch (the issue's
target: at most 1.1). A first step of each checks that both give the same output and q/k/v gradients.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
import torch.distributed as dist
from _harness import interleaved_times
from _torch_ring import cp_options, torch_ring_attention
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

from reference.arguments import add_flag
from reference.context_parallel import ring_attention, shard
from reference.distributed import distributed, one_line_errors

ROTATERS = {"allgather": torch_cp._RotateMethod.ALL_GATHER, "alltoall": torch_cp._RotateMethod.ALL_TO_ALL}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(parser, "--micro-batch-size", "--batch-size", dest="batch_size", type=int, default=2)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--seq-length", type=int, default=1024, help="whole sequence; 2 x cp chunks must divide it (balanced)"
    )
    parser.add_argument("--rotate", choices=ROTATERS, default="allgather", help="torch's K/V rotater")
    parser.add_argument(
        "--rounds", type=int, default=10, help="rounds; each times one step of every implementation, in turn"
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return parser.parse_args()


def torch_step(q, k, v, grad, group, mesh) -> tuple[torch.Tensor, ...]:
    """torch's ring forward then backward on this rank's shards: (out, dq, dk, dv)."""
    if q.device.type == "cpu":
        return torch_ring_attention(group, q, k, v, grad)
    # CUDA: torch's own ring flash wrappers, the backward fed the forward's extra outputs as its dispatcher does
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch_cp._scaled_dot_product_ring_flash_attention(
        mesh, q, k, v, is_causal=True
    )
    grads = torch_cp._scaled_dot_product_ring_flash_attention_backward(
        mesh, grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset
    )
    return out, *grads[:3]


def reference_step(q, k, v, grad, group) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, group, balanced=True)
    out.backward(grad)
    return out.detach(), *(t.grad for t in leaves)


def main():
    args = parse_args()
    with one_line_errors("bench_ring_attention"), distributed() as device:  # a length 2 cp does not divide
        _benchmark(args, device)


def _benchmark(args, device: torch.device) -> None:
    cuda = device.type == "cuda"
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    mesh = init_device_mesh(device.type, (world,))
    dtype = torch.bfloat16 if cuda else torch.float32  # the CUDA flash kernel takes half precision only
    g = torch.Generator().manual_seed(0)
    whole = [
        torch.randn(args.batch_size, args.num_attention_heads, args.seq_length, args.head_dim, generator=g)
        for _ in range(4)
    ]
    q, k, v, grad = (shard(t, 2, rank, world).to(device, dtype) for t in whole)  # one line if 2 cp does not divide
    steps = {
        "reference": functools.partial(reference_step, q, k, v, grad, group),
        "torch": functools.partial(torch_step, q, k, v, grad, group, mesh),
    }
    with cp_options(enable_load_balance=True, rotate_method=ROTATERS[args.rotate]):
        first = {name: step() for name, step in steps.items()}  # also the warm-up
        for name, ours, theirs in zip(("out", "dq", "dk", "dv"), first["reference"], first["torch"]):
            tol = 2e-2 if cuda else 1e-4
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol, msg=f"{name} differs")
        times = interleaved_times(steps, args.rounds, cuda)
    if rank != 0:
        return
    median = {name: statistics.median(t) for name, t in times.items()}
    best = {name: min(t) for name, t in times.items()}  # the least disturbed step: steadier on a busy machine
    if args.json:
        report = {
            "cp": world,
            "device": device.type,
            "rotate": args.rotate,
            "median_ms": {name: t * 1e3 for name, t in median.items()},
            "min_ms": {name: t * 1e3 for name, t in best.items()},
            "ratios": {
                "time reference/torch (median)": median["reference"] / median["torch"],
                "time reference/torch (min)": best["reference"] / best["torch"],
            },
        }
        print(json.dumps(report))
        return
    print(
        f"CP={world} on {device.type} ({'nccl' if cuda else 'gloo'}), causal, head-tail balanced, "
        f"b={args.batch_size} heads={args.num_attention_heads} s={args.seq_length} d={args.head_dim} {str(dtype)[6:]}, "
        f"torch rotater {args.rotate}; median of {args.rounds} interleaved fwd+bwd steps each"
    )
    for name in steps:
        print(f"  {name:10s} fwd+bwd {median[name] * 1e3:9.2f} ms/step  (min {best[name] * 1e3:.2f})")
    for label, stat in (("median", median), ("min", best)):
        print(f"  by {label:6s}: reference / torch = {stat['reference'] / stat['torch']:.3f}  (target <= 1.1)")


if __name__ == "__main__":
    main()

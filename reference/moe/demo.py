"""The MoE demo: `torchrun --nproc-per-node N -m reference --moe --ep E [--tp T] --device cpu`.

A few SGD steps of one mixture-of-experts layer (reference.moe) split over EP (x TP), fitting a fixed random
teacher on synthetic tokens; every rank's tokens differ, as in training. Rank 0 prints the layout, then per step
the loss and the (token, expert) pairs each expert got and dropped, and after the last step each rank's
all-to-all bytes beside the closed form, with the split sizes and, under TP, the other collectives. `--json`: a
`{"config": ...}` line, then one object per step with every rank's routing, split sizes and recorded
collectives (the MoE walkthrough's traces, tools/record-traces).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from reference.arguments import add_flag, experts, positive_finite, refuse_large_memory, width
from reference.distributed import distributed, one_line_errors, pick_dtype
from reference.measure.recorder import CollectiveRecorder
from reference.moe.layer import MoELayer
from reference.moe.parallelize import parallelize_moe
from reference.parallel_state import Mesh, ParallelConfigError, build_layout, divide, parallel_sizes


def add_arguments(group) -> None:
    """Add the MoE flags to the shared parser's argument group (Megatron-LM's spellings)."""
    add_flag(
        group,
        "--ep",
        "--expert-parallel",
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="expert-parallel size: ranks splitting the experts, carved out of DP (it must divide world / tp)",
    )
    group.add_argument("--num-experts", type=experts, default=8, help="experts E in the layer")
    group.add_argument("--moe-router-topk", type=int, default=2, help="experts per token k")
    group.add_argument(
        "--moe-expert-capacity-factor",
        type=positive_finite("capacity factor"),
        default=None,
        help="drop what an expert gets beyond ceil(T k / E x factor) of a rank's T tokens; default: dropless",
    )
    group.add_argument(
        "--moe-aux-loss-coeff", type=float, default=1e-2, help="load-balancing loss coefficient (0: off)"
    )
    group.add_argument(
        "--moe-ffn-hidden-size", type=width, default=None, help="each expert's hidden size; default: 2 h"
    )


def _check(args) -> tuple[int, int]:
    """(world, dp), with every refusal before any process group starts."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.pp != 1 or args.fsdp:
        raise ParallelConfigError("--moe runs one MoE layer: no --pp and no --fsdp")
    if args.num_experts < 1 or not 1 <= args.moe_router_topk <= args.num_experts:
        raise ParallelConfigError(
            f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts {args.num_experts}"
        )
    if args.moe_expert_capacity_factor is not None and not args.moe_expert_capacity_factor > 0:
        raise ParallelConfigError(
            f"--moe-expert-capacity-factor must be positive, got {args.moe_expert_capacity_factor}"
        )
    if min(args.steps, args.batch_size, args.ep) < 1:
        raise ParallelConfigError("--steps, --micro-batch-size and --ep must be >= 1")
    tp, _, dp = parallel_sizes(world, args.tp, 1, args.dp)
    Mesh(tp, 1, dp, ep=args.ep)  # refuses an EP size that does not divide dp
    divide(args.num_experts, args.ep, "--num-experts", by="--ep")
    divide(args.seq_length, tp, "--seq-length", by="--tp (each TP rank routes its slice of the sequence)")
    if why := refuse_large_memory("this MoE layer", memory_per_rank(args, tp)):
        raise ParallelConfigError(why)
    return world, dp


def memory_per_rank(args, tp: int) -> dict[str, float]:
    """Bytes a rank is estimated to need, fp32, named by the flags that size them: its experts' weights and
    gradients (and the router's), the routed tokens' activations, and the sequence every rank draws whole."""
    h, ffn, k = args.hidden_size, args.moe_ffn_hidden_size or 2 * args.hidden_size, args.moe_router_topk
    routed = args.seq_length // tp * args.batch_size * k
    return {
        "experts (--num-experts / --ep x --hidden-size x --moe-ffn-hidden-size)": 4.0
        * 2
        * (args.num_experts // args.ep * 2 * h * ffn / tp + args.num_experts * h),
        "routed tokens (--seq-length x --micro-batch-size x --moe-router-topk)": 4.0 * 4 * routed * (2 * h + ffn),
        "the batch (--seq-length x --micro-batch-size x --hidden-size)": 4.0
        * 4
        * args.seq_length
        * args.batch_size
        * h,
    }


def run(args) -> None:
    with one_line_errors("reference"):
        _check(args)
        with distributed(args.device) as device:
            _train(args, device)


def synthetic_tokens(args, step: int, replica: int, teacher: torch.Tensor, tp_rank: int, tp: int, device, dtype):
    """This rank's input [s/tp, b, h] and target: its replica's sequence for this step, its TP slice."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step * 97 + replica)
    x = torch.randn(args.seq_length, args.batch_size, args.hidden_size, generator=gen)
    y = torch.tanh(x @ teacher)
    return (t.chunk(tp)[tp_rank].to(device=device, dtype=dtype) for t in (x, y))


def _train(args, device: torch.device) -> None:
    layout = build_layout(args.tp, 1, args.dp, ep_size=args.ep)
    rank, text, tp, world = dist.get_rank(), not args.json, layout.tp_size, dist.get_world_size()
    dtype = pick_dtype(args.dtype, device)
    h, experts, k = args.hidden_size, args.num_experts, args.moe_router_topk
    torch.manual_seed(args.seed)
    layer = MoELayer(
        h,
        args.moe_ffn_hidden_size or 2 * h,
        experts,
        k,
        aux_loss_coeff=args.moe_aux_loss_coeff,
        capacity_factor=args.moe_expert_capacity_factor,
        params_dtype=dtype,
        device=device,
    )
    layer = parallelize_moe(layer, layout)
    teacher = torch.randn(h, h, generator=torch.Generator().manual_seed(args.seed + 1)) / h**0.5
    optimizer = torch.optim.SGD(layer.parameters(), lr=args.lr)
    mode = (
        "dropless" if args.moe_expert_capacity_factor is None else f"capacity factor {args.moe_expert_capacity_factor}"
    )
    ffn, tokens = args.moe_ffn_hidden_size or 2 * h, args.seq_length // tp * args.batch_size
    if rank == 0 and not text:  # what the step lines that follow ran: a trace's header (tools/record-traces)
        config = {
            **dict(world=world, tp=tp, ep=layout.ep_size, dp=layout.dp_size, steps=args.steps, seed=args.seed),
            **dict(hidden_size=h, ffn_hidden_size=ffn, num_experts=experts, topk=k, tokens_per_rank=tokens),
            **dict(experts_per_rank=experts // layout.ep_size, seq_length=args.seq_length, batch_size=args.batch_size),
            **dict(capacity_factor=args.moe_expert_capacity_factor, aux_loss_coeff=args.moe_aux_loss_coeff),
            **dict(dtype=str(dtype).removeprefix("torch."), dtype_size=torch.finfo(dtype).bits // 8),
        }
        print(json.dumps({"config": config}), flush=True)
    if rank == 0 and text:
        print(layout.describe(), flush=True)
        print(
            f"MoE layer: h {h}, {experts} experts of ffn {ffn}, top-{k}, {mode}, "
            f"{experts // layout.ep_size} experts per EP rank; {tokens} tokens per rank per step",
            flush=True,
        )
    for step in range(1, args.steps + 1):
        x, y = synthetic_tokens(args, step, layout.dp_rank, teacher, layout.tp_rank, tp, device, dtype)
        x.requires_grad_()  # as a layer's input is: the dispatch all-to-all gets its backward
        with CollectiveRecorder() as recorder:
            out = layer(x)
            loss = torch.nn.functional.mse_loss(out.float(), y.float())
            (loss / world).backward()  # the mean over every rank's tokens (equal counts)
        with torch.no_grad():
            routing_map = layer.router(x.detach().reshape(-1, h))[1]  # what was routed (same weights, pre-step)
        _reduce_grads(layer, layout)
        optimizer.step()
        optimizer.zero_grad()
        report = _report(step, loss, routing_map, recorder, layer, layout, experts, k, h, x.element_size())
        if rank == 0:
            if args.json:
                print(json.dumps(report), flush=True)
            else:
                _print(report, k, step == args.steps)


def _reduce_grads(layer: MoELayer, layout) -> None:
    """The router is replicated on every rank and saw only this rank's tokens: sum its gradient over all ranks.
    Each expert slice is held by the ranks of one expert-DP group, which saw different tokens: sum over it."""
    dist.all_reduce(layer.router.weight.grad)
    if layout.expert_dp_group is not None and layout.expert_dp_group.size() > 1:
        for param in layer.experts.parameters():
            dist.all_reduce(param.grad, group=layout.expert_dp_group)


def _report(step, loss, routing_map, recorder, layer, layout, experts, topk, h, element_size) -> dict:
    """The step's numbers, summed over ranks: loss, pairs per expert, dropped pairs; and per rank its routing
    (pairs per expert, the dispatcher's split sizes, rows per local expert), every collective it issued in
    forward and backward, and its all-to-all bytes beside the closed form."""
    per_expert = routing_map.sum(dim=0).to(torch.float64)
    sent = routing_map.sum().item()
    if layout.ep_group is not None:  # pairs my experts receive: every EP peer's counts for them
        counts = [torch.zeros_like(per_expert) for _ in range(layout.ep_size)]
        dist.all_gather(counts, per_expert, group=layout.ep_group)
        first, local = layout.ep_group.rank() * (experts // layout.ep_size), experts // layout.ep_size
        received = sum(c[first : first + local].sum().item() for c in counts)
    else:
        received = sent
    a2a = [e for e in recorder.events if e.op == "all_to_all"]
    row = h * element_size
    closed = (experts * 8 + 2 * (sent + received) * row) if a2a else 0  # counts, then rows both ways, fwd + bwd
    dispatcher, local = layer.dispatcher, experts // layout.ep_size
    mine = {
        "rank": dist.get_rank(),
        "ep_group": dist.get_process_group_ranks(layout.ep_group) if layout.ep_group else [dist.get_rank()],
        "tp_group": dist.get_process_group_ranks(layout.tp_group),
        "loss": loss.item(),
        "tokens": routing_map.shape[0],
        "pairs_per_expert": [int(c) for c in per_expert.tolist()],
        "input_splits": [int(n) for n in dispatcher.input_splits],  # rows to each EP rank, from the forward
        "output_splits": [int(n) for n in dispatcher.output_splits],  # rows from each
        "rows_per_local_expert": [sum(dispatcher.chunk_sizes[e::local]) for e in range(local)],
        "sent": int(sent),
        "received": int(received),
        "a2a_bytes": sum(e.nbytes for e in a2a),
        "closed_form": int(closed),
        "collectives": [
            {
                "op": e.op,
                "phase": e.phase,
                "group_ranks": list(e.group_ranks),
                "dtype": e.dtype,
                "shape": list(e.shape),
                "nbytes": e.nbytes,
            }
            for e in recorder.events
        ],
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    dist.all_reduce(per_expert)
    tokens = routing_map.shape[0] * dist.get_world_size()  # every rank routes as many
    return {
        "step": step,
        "loss": sum(r.pop("loss") for r in every) / len(every),
        "pairs_per_expert": [int(c) for c in per_expert.tolist()],
        "tokens": tokens,
        "dropped": tokens * topk - int(per_expert.sum().item()),
        "ranks": every,
    }


def _print(report: dict, k: int, last: bool) -> None:
    print(
        f"step {report['step']}: loss {report['loss']:.6f}; pairs per expert {report['pairs_per_expert']} "
        f"({report['tokens']} tokens x top-{k}, {report['dropped']} dropped)",
        flush=True,
    )
    if last:
        print(
            "all-to-all bytes of the last step per rank ([pairs to / from each EP rank]; counts E x 8 B, then h "
            "values per pair, both ways):"
        )
        for r in report["ranks"]:
            print(
                f"  rank {r['rank']}: sent {r['sent']} pairs {r['input_splits']}, received {r['received']} "
                f"{r['output_splits']}: recorded {r['a2a_bytes']} B, closed form {r['closed_form']} B",
                flush=True,
            )
            if others := _other_collectives(r["collectives"]):
                print(f"    other collectives: {others}", flush=True)


def _other_collectives(events: list[dict]) -> str:
    """Every collective but the all-to-alls, by op, over which group: "all_gather x3 (33920 B), ... over [0, 1]"
    (under TP, the expert-TP gather and reduce-scatter and the load-balancing loss's counts)."""
    counts: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for e in events:
        if e["op"] != "all_to_all":
            counts.setdefault((e["op"], tuple(e["group_ranks"])), []).append(e["nbytes"])
    return "; ".join(f"{op} x{len(sizes)} ({sum(sizes)} B) over {list(group)}" for (op, group), sizes in counts.items())

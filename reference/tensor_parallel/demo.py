"""`torchrun --nproc-per-node N -m reference`: train the TP transformer for a few steps and show its traffic.

Each step prints the loss and the collectives the step issued, from the CollectiveRecorder, split into
forward, backward and gradient synchronization (the sequence-parallel LayerNorm/bias all-reduce and the
data-parallel all-reduce, both after backward). With one data-parallel replica the loss does not depend on
the TP size: the same seed gives the same master weights and data at every TP size (compare
`torchrun --nproc-per-node 1 -m reference` with `--nproc-per-node 2`).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from reference.distributed import LaunchError, distributed
from reference.parallel_state import ParallelConfigError, build_layout
from reference.recorder import CollectiveRecorder
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads
from reference.tensor_parallel.transformer import ParallelTransformer

def add_arguments(group) -> None:
    """Add the tensor-parallel flags to the shared parser's argument group."""
    group.add_argument("--tp-size", type=int, default=None,
                       help="tensor-parallel size, the rest of the world being data-parallel; None: the whole world")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="split LayerNorm/dropout/residual activations along the sequence: each all-reduce "
                            "becomes an all-gather + reduce-scatter")
    group.add_argument("--pad-sequence", action="store_true",
                       help="with --sequence-parallel, pad a sequence length that --tp-size does not divide "
                            "instead of refusing it")
    group.add_argument("--no-async-grad-allreduce", action="store_true",
                       help="wait for the input-gradient all-reduce/reduce-scatter before computing the weight "
                            "gradient, instead of overlapping the two")
    group.add_argument("--no-grad-accumulation-fusion", action="store_true",
                       help="let autograd write weight gradients to .grad instead of accumulating them into the "
                            "persistent fp32 main_grad buffer")
    group.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout probability")


def run(args) -> None:
    try:
        with distributed(args.device) as device:
            _train(args, device)
    except (LaunchError, ParallelConfigError) as error:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"reference: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _train(args, device: torch.device) -> None:
    if args.steps < 1 or min(args.batch_size, args.seq_length, args.hidden_size, args.num_layers) < 1:
        raise ParallelConfigError("--steps, --batch-size, --seq-length, --hidden-size, --num-layers must be >= 1")
    layout = build_layout(args.tp_size or dist.get_world_size())
    rank, text = dist.get_rank(), not args.json
    if rank == 0 and text:
        print(layout.describe(), flush=True)
    torch.manual_seed(args.seed)  # same master weights on every rank, whatever the TP size
    model = ParallelTransformer(
        args.num_layers, args.hidden_size, args.num_attention_heads, tp_group=layout.tp_group,
        sequence_parallel=args.sequence_parallel, pad_sequence=args.pad_sequence,
        hidden_dropout=args.dropout, attention_dropout=args.dropout, dropout_seed=args.seed,
        async_grad_allreduce=not args.no_async_grad_allreduce,
        gradient_accumulation_fusion=not args.no_grad_accumulation_fusion, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(args.seed + 1 + layout.dp_rank)  # one stream per DP replica
    recorder = CollectiveRecorder()
    recorder.watch(model)
    for step in range(args.steps):
        x = torch.randn(args.seq_length, args.batch_size, args.hidden_size, generator=data).to(device)
        target = torch.randn(x.shape, generator=data).to(device)
        recorder.clear()
        start = time.perf_counter()
        with recorder:
            with recorder.span("forward"):
                loss = torch.nn.functional.mse_loss(model(x), target)
            with recorder.span("backward"):
                loss.backward()
            with recorder.scope("grad_sync"), recorder.span("grad_sync"):
                _synchronize_grads(model, layout)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for param in model.parameters():
            if hasattr(param, "main_grad"):
                param.main_grad.zero_()
        _report(args, step, loss, time.perf_counter() - start, recorder, layout)
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
        (args.trace / f"tp_trace.rank{rank}.json").write_text(recorder.to_json())


def _synchronize_grads(model: torch.nn.Module, layout) -> None:
    """Finish the gradients: SP partial sums over TP, then the mean over data-parallel replicas."""
    allreduce_sequence_parallel_grads(model, layout.tp_group)
    for param in model.parameters():
        if hasattr(param, "main_grad"):  # gradient-accumulation fusion: the optimizer reads main_grad
            param.grad = param.main_grad.to(param.dtype)
    if layout.dp_size > 1:  # one flat all-reduce, as a DDP bucket would
        grads = [param.grad for param in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=layout.dp_group)
        for grad, reduced in zip(grads, flat.div_(layout.dp_size).split([g.numel() for g in grads])):
            grad.copy_(reduced.view_as(grad))


def _report(args, step, loss, seconds, recorder, layout) -> None:
    if dist.get_rank() != 0:
        return
    events = recorder.events
    parts = {"forward": recorder.summary("forward", [e for e in events if e.module != "grad_sync"]),
             "backward": recorder.summary("backward"),
             "grad_sync": recorder.summary(events=[e for e in events if e.module == "grad_sync"])}
    if args.json:
        print(json.dumps({"step": step, "loss": loss.item(), "seconds": seconds, "tp_size": layout.tp_size,
                          "dp_size": layout.dp_size, "collectives": parts}), flush=True)
        return
    def fmt(ops):
        return ", ".join(f"{op} x{v['count']} ({v['bytes']} B)" for op, v in ops.items()) or "none"
    print(f"step {step}: loss {loss.item():.6f} ({seconds * 1e3:.1f} ms) | "
          + " | ".join(f"{name}: {fmt(ops)}" for name, ops in parts.items()), flush=True)

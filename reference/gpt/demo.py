"""`torchrun --nproc-per-node 8 -m reference --tp 2 --pp 2 --dp 2`: train the small GPT with TP x PP x DP.

Prints the layout, then per step the global loss, rank 0's parameter bytes and its collectives per process
group (tp, pp, dp), then each stage's schedule, in-flight peak and bubble (the recorded orders replayed with
equal stages and at their recorded FLOPs, and the wall clock's), then every rank's memory. `--model
llama` trains the Llama/Qwen2 block; `--dp-sharding fsdp` or `fsdp2` (2D), `optimizer` (ZeRO-1) or
`gradients` (ZeRO-2) shard over DP; `--virtual-stages v` interleaves. The loss does not depend on the layout:
the same seed gives the same model and data everywhere. docs/reference-guide.md lists the demos and what each prints.

The script is the training loop and nothing else: parse (reference.gpt.arguments), build the layout, build
the plain model, `parallelize` it (reference.parallelize), train, report (reference.measure.report), as
torchtitan's train loop and picotron's train.py.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from reference.data_parallel.mixed_precision import model_chunks
from reference.distributed import OPTIMIZERS, distributed, one_line_errors, pick_dtype
from reference.fsdp.units import sharded_parameter_bytes
from reference.gpt.arguments import add_arguments, check
from reference.gpt.model import GPT, GPTConfig
from reference.gpt.parallelize import stage_layers
from reference.gpt.train import synthetic_batches, train_step
from reference.measure import report
from reference.measure.fsdp_tracing import unit_scopes
from reference.measure.pipeline_meter import PipelineMeter
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.parallelize import ParallelizeConfig, build_optimizer, parallelize

__all__ = ["add_arguments", "run"]


def run(args) -> None:
    with one_line_errors("reference"):
        config = check(args)
        with distributed(args.device) as device:
            _train(args, config, device)


def _train(args, config: GPTConfig, device: torch.device) -> None:
    layout = build_layout(args.tp, args.pp, args.dp, cp_size=args.cp)
    torch.manual_seed(args.seed)  # dropout on replicated activations draws from here: the same masks every run
    rank, text = dist.get_rank(), not args.json
    bf16 = pick_dtype(args.dtype, device) == torch.bfloat16
    plan = ParallelizeConfig(
        sequence_parallel=args.sequence_parallel,
        async_grad_allreduce=not args.no_async_grad_allreduce,
        seed=args.seed,
        recompute=args.recompute,
        dp_sharding=args.dp_sharding,
        bucket_size=args.bucket_size,
        overlap_grad_reduce=not args.no_overlap_grad_reduce,
        bf16=bf16,
    )
    if rank == 0 and text:
        print(layout.describe(), flush=True)
        print(f"dtype: {report.precision(bf16, args.dp_sharding)}", flush=True)
    params_dtype = torch.bfloat16 if bf16 and not plan.fully_sharded else torch.float32  # FSDP: fp32 shards
    chunks = [
        GPT(config, args.seed, device, layers=layers, params_dtype=params_dtype)
        for layers in stage_layers(config, layout, args.virtual_stages, args.schedule)
    ]
    recorder = CollectiveRecorder()

    def watch(split: list[torch.nn.Module]) -> None:  # the plain model's module names, before any DP wrapper
        for c, chunk in enumerate(split):
            recorder.watch(chunk, prefix=f"chunk{c}" if len(split) > 1 else "")

    model = parallelize(chunks if len(chunks) > 1 else chunks[0], layout, plan, observe=watch)
    params = [param for chunk in model_chunks(model) for param in chunk.parameters()]
    held = sum(p.numel() * p.element_size() for p in params)  # this rank's parameter bytes, every chunk
    param_bytes = None  # only rank 0 reports: only it builds the whole model, to count its bytes
    if rank == 0:
        param_bytes = {
            "param_bytes_per_rank": held,
            "param_bytes_unsharded": sharded_parameter_bytes(GPT(config, args.seed, params_dtype=params[0].dtype)),
        }
    optimizer = build_optimizer(model, plan, lambda tensors: OPTIMIZERS[args.optimizer](tensors, lr=args.lr))
    global_batch, meter = args.batch_size * args.micro_batches * layout.dp_size, PipelineMeter(device)
    with unit_scopes(model) if plan.fully_sharded else contextlib.nullcontext():  # units in the trace
        for step, tokens in enumerate(synthetic_batches(config, args.steps, global_batch, args.seed)):
            recorder.clear()
            loss = train_step(
                model,
                optimizer,
                tokens,
                layout,
                num_micro_batches=args.micro_batches,
                schedule=args.schedule,
                device=device,
                record=recorder,
                observer=meter,
            )
            report.report_step(args, step, loss, meter.total_s, recorder, layout, param_bytes, bf16)
    stages = [None] * dist.get_world_size() if rank == 0 else None  # only rank 0 reports
    dist.gather_object(meter.to_dict(), stages, dst=0)
    if rank == 0:
        report.report_pipeline(args, [stages[r] for r in layout.grid.flatten(1)[:, 0].tolist()], device)
    memory = [None] * dist.get_world_size() if rank == 0 else None
    held_between_steps = report.state_bytes(model, optimizer, plan.fully_sharded)
    dist.gather_object(
        {"rank": rank, "param_bytes": held, **held_between_steps, "peak_activation_bytes": meter.peak_activation_bytes},
        memory,
        dst=0,
    )
    if rank == 0:
        report.report_memory(args, memory)
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
        (args.trace / f"gpt_trace.rank{rank}.json").write_text(recorder.to_json())

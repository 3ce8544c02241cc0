"""`torchrun --nproc-per-node 8 -m reference --tp 2 --pp 2 --dp 2`: train the small GPT with TP x PP x DP.

Prints the layout, then per step the global loss, rank 0's parameter bytes and its collectives per process
group (tp, pp, dp), then each stage's schedule, in-flight peak and bubble (the recorded orders replayed with
equal stages and at their recorded FLOPs, and the wall clock's), then every rank's memory. `--model
llama` trains the Llama/Qwen2 block; `--dp-sharding fsdp` or `fsdp2` (2D), `optimizer` (ZeRO-1) or
`gradients` (ZeRO-2) shard over DP; `--virtual-stages v` interleaves. The loss does not depend on the layout:
the same seed gives the same model and data everywhere. docs/reference-guide.md lists the demos and what each prints.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.distributed as dist

from reference.data_parallel.buckets import GradBucket
from reference.data_parallel.distributed_optimizer import DistributedOptimizer, bytes_per_rank
from reference.data_parallel.fsdp2_tp import fully_shard_tp_model
from reference.data_parallel.gradient_shards import ShardedGradBucket, ShardedGradOptimizer
from reference.data_parallel.mixed_precision import model_chunks, unsharded
from reference.data_parallel.wrapper import DEFAULT_BUCKET_SIZE
from reference.distributed import OPTIMIZERS, distributed, one_line_errors, pick_dtype
from reference.fsdp.units import sharded_parameter_bytes
from reference.fsdp.wrapper import MixedPrecision
from reference.fsdp2 import MixedPrecisionPolicy
from reference.gpt.model import GPT, STYLES, GPTConfig, split_layers
from reference.gpt.parallelize import build_chunks, build_stage, check_tensor_parallel, check_virtual_pipeline
from reference.gpt.train import data_parallel, fully_sharded, synthetic_batches, train_step
from reference.measure.fsdp_tracing import unit_scopes
from reference.measure.pipeline_meter import PipelineMeter
from reference.measure.recorder import CollectiveRecorder
from reference.measure.replay import idle_fractions, replay, uniform_costs
from reference.parallel_state import ParallelConfigError, build_layout, parallel_sizes
from reference.pipeline.schedules import SCHEDULES, peak_in_flight_formula
from reference.recompute import RECOMPUTE_MODES

MODELED_TFLOPS = 100.0  # the modeled timeline's FLOP rate: a GPU's dense rate, in order of magnitude
FSDP = {"fsdp": "FSDP", "fsdp2": "FSDP2"}  # --dp-sharding's fully sharded choices: the reference each runs
ZERO = {"optimizer": "the optimizer state", "gradients": "the gradients and the optimizer state"}  # ZeRO-1, 2


def add_arguments(group) -> None:
    """Add the 3D-parallel flags to the shared parser's argument group."""
    group.add_argument(
        "--model",
        choices=STYLES,
        default="gpt2",
        help="the block: gpt2 (LayerNorm, GELU, learned positions) or llama (the Llama/Qwen2 block: "
        "RMSNorm, SwiGLU, rotary positions, grouped-query attention)",
    )
    group.add_argument(
        "--num-kv-heads",
        type=int,
        default=None,
        help="llama: key/value heads (query groups), split over --tp; default: half the attention heads",
    )
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel size: ranks splitting every layer")
    group.add_argument("--pp", type=int, default=1, help="pipeline-parallel size: stages of consecutive layers")
    group.add_argument(
        "--dp",
        type=int,
        default=None,
        help="data-parallel size: model replicas; default: world / (tp x pp). tp x pp x dp must equal the world size",
    )
    group.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="1f1b",
        help="pipeline schedule: all forwards then all backwards (gpipe), or one-forward-one-"
        "backward after a warm-up (1f1b: at most pp micro-batches in flight)",
    )
    group.add_argument(
        "--virtual-stages",
        type=int,
        default=1,
        metavar="V",
        help="model chunks per pipeline stage; V > 1 runs interleaved 1F1B, whose bubble is "
        "(pp - 1) / (V m + pp - 1); needs the layers divisible by pp x V and m by pp",
    )
    group.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches m per step and replica; the bubble is (pp - 1) / (m + pp - 1); "
        "default: 4, or 1 with --dp-sharding fsdp or fsdp2",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split LayerNorm/dropout/residual activations along the sequence over TP: each "
        "all-reduce becomes an all-gather + reduce-scatter, stages exchange [s/tp, b, h]",
    )
    group.add_argument("--vocab-size", type=int, default=128, help="vocabulary size (padded to a multiple of tp)")
    group.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout probability")
    group.add_argument(
        "--dp-sharding",
        choices=["replicate", "optimizer", "gradients", "fsdp", "fsdp2"],
        default="replicate",
        help="replicate: every DP rank holds the stage and all-reduces gradients in buckets (DDP); "
        "optimizer: the distributed optimizer (ZeRO-1) shards the optimizer state over DP "
        "(reduce-scatter gradients, all-gather parameters; needs dp > 1); "
        "gradients: ZeRO-2, the same, and each rank keeps only its shard of the reduced gradients "
        "(parameters whole: 2 + (2 + 12) / dp bytes per parameter with bf16 gradients and Adam); "
        "fsdp: reference FSDP over the DP group shards the TP-sharded stage (2D, all-gathers "
        "and reduce-scatters; needs --pp 1 and --micro-batches 1); fsdp2: the same with the reference FSDP2, "
        "each TP-local parameter sharded on dim 0 (as fully_shard over DTensor TP)",
    )
    group.add_argument(
        "--bucket-size",
        type=int,
        default=DEFAULT_BUCKET_SIZE,
        metavar="BYTES",
        help="data-parallel gradient bucket size: one all-reduce per bucket over the DP group",
    )
    group.add_argument(
        "--no-overlap-grad-reduce",
        action="store_true",
        help="issue the data-parallel bucket all-reduces after backward instead of as soon as "
        "each bucket's gradients are ready (during the last micro-batch's backward)",
    )
    group.add_argument(
        "--recompute",
        choices=RECOMPUTE_MODES,
        default="none",
        help="activation recomputation per block: keep everything for backward (none), keep only "
        "the attention core's input and recompute QK^T/softmax/dropout/xV (selective), or keep "
        "only each block's input and recompute the block (full); same gradients in all three",
    )
    group.add_argument(
        "--no-async-grad-allreduce",
        action="store_true",
        help="wait for the input-gradient all-reduce/reduce-scatter before computing the weight "
        "gradient, instead of overlapping the two",
    )


def _config(args) -> GPTConfig:
    """Everything that can be checked before starting the processes: one-line errors, no hang."""
    fsdp = args.dp_sharding in FSDP
    if args.micro_batches is None:
        args.micro_batches = 1 if fsdp else 4
    if fsdp and (args.pp > 1 or args.micro_batches > 1):
        raise ParallelConfigError(
            f"--dp-sharding {args.dp_sharding} needs --pp 1 and --micro-batches 1 (got --pp {args.pp} "
            f"--micro-batches {args.micro_batches}): the reference {FSDP[args.dp_sharding]} has no no_sync, so it "
            "cannot accumulate gradients over micro-batches and reduce-scatter once; use --dp-sharding replicate "
            "for pipelining"
        )
    if args.dp_sharding in ZERO:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        _, _, dp = parallel_sizes(world, args.tp, args.pp, args.dp)
        if dp == 1:
            raise ParallelConfigError(
                f"--dp-sharding {args.dp_sharding} shards {ZERO[args.dp_sharding]} over the data-parallel group, "
                f"but dp is 1 "
                f"(world {world} / (tp {args.tp} x pp {args.pp})): nothing to shard; launch more ranks or use "
                "--dp-sharding replicate"
            )
    if min(args.steps, args.batch_size, args.micro_batches, args.bucket_size) < 1:
        raise ParallelConfigError("--steps, --micro-batch-size, --micro-batches and --bucket-size must be >= 1")
    if args.num_kv_heads is not None and (args.model != "llama" or args.num_kv_heads < 1):
        raise ParallelConfigError(f"--num-kv-heads {args.num_kv_heads}: needs --model llama and a positive count")
    kv_heads = args.num_kv_heads or max(1, args.num_attention_heads // 2)
    config = GPTConfig.from_sizes(
        args,
        hidden_dropout=args.dropout,
        attention_dropout=args.dropout,
        style=args.model,
        num_kv_heads=kv_heads if args.model == "llama" else None,
    )
    split_layers(config.num_layers, args.pp)
    check_tensor_parallel(config, args.tp, args.sequence_parallel)
    if args.virtual_stages != 1:
        if args.schedule != "1f1b" or fsdp:
            raise ParallelConfigError(
                f"--virtual-stages {args.virtual_stages} needs --schedule 1f1b and "
                "--dp-sharding replicate or optimizer (interleaved 1F1B over DDP-wrapped "
                "chunks)"
            )
        check_virtual_pipeline(config.num_layers, args.pp, args.virtual_stages, args.micro_batches)
    return config


def run(args) -> None:
    with one_line_errors("reference"):
        config = _config(args)
        with distributed(args.device) as device:
            _train(args, config, device)


def _train(args, config: GPTConfig, device: torch.device) -> None:
    layout = build_layout(args.tp, args.pp, args.dp)
    torch.manual_seed(args.seed)  # dropout on replicated activations draws from here: the same masks every run
    rank, text = dist.get_rank(), not args.json
    bf16 = pick_dtype(args.dtype, device) == torch.bfloat16
    fsdp = args.dp_sharding in FSDP  # bf16 as FSDP's mixed precision: bf16 compute over fp32 shards
    if rank == 0 and text:
        print(layout.describe(), flush=True)
        print(f"dtype: {_precision(bf16, args.dp_sharding)}", flush=True)
    kwargs = dict(
        params_dtype=torch.bfloat16 if bf16 and not fsdp else torch.float32,
        sequence_parallel=args.sequence_parallel,
        seed=args.seed,
        device=device,
        async_grad_allreduce=not args.no_async_grad_allreduce,
        recompute=args.recompute,
    )
    chunks = (
        build_chunks(config, layout, args.virtual_stages, **kwargs)
        if args.virtual_stages > 1
        else [build_stage(config, layout, **kwargs)]
    )
    recorder = CollectiveRecorder()
    for c, chunk in enumerate(chunks):
        recorder.watch(chunk, prefix=f"chunk{c}" if len(chunks) > 1 else "")
    if args.dp_sharding == "fsdp":
        precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        model = fully_sharded(chunks[0], layout, mixed_precision=precision)
    elif args.dp_sharding == "fsdp2":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        model = fully_shard_tp_model(chunks[0], layout, mp_policy=policy or MixedPrecisionPolicy())
    else:
        wrapped = [
            data_parallel(
                chunk,
                layout,
                bucket_size=args.bucket_size,
                overlap_grad_reduce=not args.no_overlap_grad_reduce,
                use_distributed_optimizer=args.dp_sharding in ZERO,
                bucket_class=ShardedGradBucket if args.dp_sharding == "gradients" else GradBucket,
                grad_dtype=torch.float32 if bf16 else None,  # bf16 parameters: Megatron's fp32 main grads
            )
            for chunk in chunks
        ]
        model = wrapped if len(wrapped) > 1 else wrapped[0]
    params = [param for chunk in model_chunks(model) for param in chunk.parameters()]
    held = sum(p.numel() * p.element_size() for p in params)  # this rank's parameter bytes, every chunk
    param_bytes = None  # only rank 0 reports: only it builds the whole model, to count its bytes
    if rank == 0:
        param_bytes = {
            "param_bytes_per_rank": held,
            "param_bytes_unsharded": sharded_parameter_bytes(GPT(config, args.seed, params_dtype=params[0].dtype)),
        }
    make_optimizer = lambda tensors: OPTIMIZERS[args.optimizer](tensors, lr=args.lr)
    if fsdp:
        optimizer = make_optimizer(params)  # the shards are fp32: FSDP's own master weights
    else:  # fp32 masters of bf16 parameters (the fp32 ones step in place), as Megatron's optimizers
        sharded = {"optimizer": DistributedOptimizer, "gradients": ShardedGradOptimizer}
        optimizer = sharded.get(args.dp_sharding, unsharded)(model, make_optimizer)
    global_batch, meter = args.batch_size * args.micro_batches * layout.dp_size, PipelineMeter(device)
    with unit_scopes(model) if fsdp else contextlib.nullcontext():  # units in the trace
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
            _report_step(args, step, loss, meter.total_s, recorder, layout, param_bytes, bf16)
    stages = [None] * dist.get_world_size() if rank == 0 else None  # only rank 0 reports
    dist.gather_object(meter.to_dict(), stages, dst=0)
    if rank == 0:
        _report_pipeline(args, [stages[r] for r in layout.grid[:, 0, 0].tolist()], device)
    memory = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(
        {
            "rank": rank,
            "param_bytes": held,
            **_state_bytes(model, optimizer, fsdp),
            "peak_activation_bytes": meter.peak_activation_bytes,
        },
        memory,
        dst=0,
    )
    if rank == 0:
        _report_memory(args, memory)
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
        (args.trace / f"gpt_trace.rank{rank}.json").write_text(recorder.to_json())


def _report_step(args, step, loss: float, seconds: float, recorder, layout, param_bytes: dict | None, bf16) -> None:
    if dist.get_rank() != 0:
        return
    groups = recorder.summary_by_group(layout.group_kind, kinds=("tp", "pp", "dp")) if recorder.on else {}
    if args.json:
        print(
            json.dumps(
                {
                    "step": step,
                    "dtype": "bf16" if bf16 else "fp32",
                    "loss": loss,
                    "wall_clock_s": seconds,
                    "layout": {"tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size},
                    "dp_sharding": args.dp_sharding,
                    "schedule": args.schedule,
                    "micro_batches": args.micro_batches,
                    **param_bytes,
                    "collectives": groups,
                }
            ),
            flush=True,
        )
        return

    def fmt(ops):
        return ", ".join(f"{op} x{v['count']} ({v['bytes']} B)" for op, v in ops.items()) or "none"

    shard, total = param_bytes["param_bytes_per_rank"], param_bytes["param_bytes_unsharded"]
    print(
        f"step {step}: loss {loss:.6f} ({seconds * 1e3:.1f} ms wall clock) | parameters on rank 0 {shard} B "
        f"(unsharded {total} B, ratio {shard / total:.3f}) | "
        + (" | ".join(f"{name}: {fmt(ops)}" for name, ops in groups.items()) or "collectives not recorded"),
        flush=True,
    )


def _precision(bf16: bool, dp_sharding: str) -> str:
    if not bf16:
        return "fp32 parameters, gradients and optimizer"
    if dp_sharding in FSDP:
        policy = "MixedPrecision" if dp_sharding == "fsdp" else "MixedPrecisionPolicy"
        return f"bf16 compute over fp32 shards, gradients reduce-scattered in fp32 ({FSDP[dp_sharding]}'s {policy})"
    return "bf16 parameters and compute, fp32 main grads and fp32 master weights (Megatron's mixed precision)"


def _state_bytes(model, optimizer, fsdp: bool) -> dict[str, int]:
    """The bytes this rank holds between steps besides its parameters: gradient buffers, fp32 master copies and
    the optimizer's per-element states (Adam's two moments; SGD has none). FSDP's gradients are the shards'
    `.grad`, its masters the fp32 shards themselves."""
    if not fsdp:
        held = bytes_per_rank(model, optimizer)
        return {key: held[key] for key in ("gradients", "master_weights", "optimizer_states")}
    params = [p for p in model.parameters() if p.grad is not None]
    return {
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params),
        "master_weights": 0,
        "optimizer_states": sum(
            value.numel() * value.element_size()
            for state in optimizer.state.values()
            for key, value in state.items()
            if torch.is_tensor(value) and key != "step"
        ),
    }


def _report_memory(args, ranks: list[dict]) -> None:
    """Per rank: the bytes it holds between steps (parameters, gradients, fp32 masters, optimizer states) and the
    activation bytes autograd held at most."""
    if args.json:
        print(json.dumps({"memory": ranks}), flush=True)
        return
    print(
        "memory per rank (held between steps: parameters, gradients, fp32 master copies, optimizer states; "
        "peak activations autograd held in the last step):",
        flush=True,
    )
    for r in ranks:
        print(
            f"  rank {r['rank']}: parameters {r['param_bytes']} B, gradients {r['gradients']} B, "
            f"masters {r['master_weights']} B, optimizer {r['optimizer_states']} B, "
            f"activations {r['peak_activation_bytes']} B",
            flush=True,
        )


def _replayed(stages: list[dict], chunks: int) -> float | None:
    """Sets each stage's idle fraction when the recorded orders are replayed with transfers free: with equal
    stages (equal_stages_bubble, the schedule's own) and at each action's recorded FLOPs at MODELED_TFLOPS
    (modeled_bubble). Returns the modeled step's seconds; None, and no modeled_bubble, when no FLOPs were
    recorded (the recorder is off on a torch it cannot hook)."""
    orders = [s["actions"] for s in stages]
    for s, idle in zip(stages, idle_fractions(replay(orders, uniform_costs(orders, chunks), chunks))):
        s["equal_stages_bubble"] = idle
    if not all(sum(s["action_flops"]) for s in stages):
        for s in stages:
            s["modeled_bubble"] = None
        return None
    seconds = [[flops / (MODELED_TFLOPS * 1e12) for flops in s["action_flops"]] for s in stages]
    spans = replay(orders, seconds, chunks)
    for s, idle in zip(stages, idle_fractions(spans)):
        s["modeled_bubble"] = idle
    return max(end for stage in spans for _, end in stage)


def _wall_clock(device: torch.device) -> str:
    """What the wall-clock bubble measured, and why it is not the schedule's."""
    if device.type == "cuda":
        return "this run's, each action ended by a CUDA synchronize; transfers and launches count as idle"
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    shared = ", which they take turns on" if ranks > cores else ""
    return (
        f"this run's, {ranks} rank{'s' if ranks > 1 else ''} on {cores} CPU cores{shared}; sends, receives and "
        "Python between these small actions count as idle"
    )


def _report_pipeline(args, stages: list[dict], device: torch.device) -> None:
    p, m, v = len(stages), args.micro_batches, args.virtual_stages
    step = _replayed(stages, v)
    if args.json:
        print(json.dumps({"pipeline": stages, "modeled_tflops": MODELED_TFLOPS, "modeled_step_s": step}), flush=True)
        return
    if p == 1:  # no stages to wait on each other: nothing idles
        print(f"pipeline: none (pp 1); {m} micro-batches accumulated per step", flush=True)
        print(f"  last step: {' '.join(stages[0]['actions'])}", flush=True)
        return
    name = f"interleaved 1f1b, {v} chunks per stage" if v > 1 else args.schedule
    unit, formula = ("chunk-forwards", "(p-1)/(v m+p-1)") if v > 1 else ("micro-batches", "(p-1)/(m+p-1)")
    at_flops = (
        "not available, no FLOPs were recorded (the collective recorder is off)"
        if step is None
        else f"the same replay, each action its recorded FLOPs at {MODELED_TFLOPS:g} TFLOP/s: {step * 1e6:.2f} us a "
        "step; the stages differ (the last also runs the LM head and loss)"
    )
    header = [
        f"pipeline: {name}, pp {p}, {m} micro-batches (last step, one rank per "
        "stage); bubble: the fraction of the step a stage idles",
        "  with equal stages: the recorded orders replayed, a forward costing 1 and a backward 2, transfers free: "
        f"the schedule's own; formula {formula} = {stages[0]['bubble_formula']:.2f}",
        f"  at its FLOPs: {at_flops}",
        f"  wall clock: {_wall_clock(device)}",
    ]
    print("\n".join(header), flush=True)
    for s in stages:
        expected = peak_in_flight_formula(args.schedule, p, s["pp_rank"], m, v)
        modeled, flops = (
            ("not modeled", "")
            if step is None
            else (f"{s['modeled_bubble']:.2f}", f", {sum(s['action_flops']) / m / 1e6:.1f} MFLOP per micro-batch")
        )
        print(
            f"  stage {s['pp_rank']}: {' '.join(s['actions'])}\n"
            f"    peak in flight {s['peak_in_flight']} {unit} (autograd held {s['peak_in_flight_measured']},"
            f" {s['peak_activation_bytes']} B; expected {expected}){flops}; bubble {s['equal_stages_bubble']:.2f} "
            f"with equal stages, {modeled} at its FLOPs, wall clock {s['wall_clock_bubble']:.2f}",
            flush=True,
        )

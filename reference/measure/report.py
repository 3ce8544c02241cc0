"""What the TP x PP x DP demo (reference/gpt/demo.py) prints: each step's loss, parameter bytes and collectives
per process group; each stage's schedule, in-flight peak and bubble (the recorded orders replayed with equal stages
and at their recorded FLOPs, and the wall clock's); every rank's memory. Text by default, one JSON object a line
with --json. The demo trains; this module only formats what its observers recorded.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from reference.data_parallel.distributed_optimizer import bytes_per_rank
from reference.gpt.arguments import FSDP
from reference.measure.replay import idle_fractions, replay, uniform_costs
from reference.pipeline.schedules import peak_in_flight_formula
from reference.pipeline.zero_bubble import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES

MODELED_TFLOPS = 100.0  # the modeled timeline's FLOP rate: a GPU's dense rate, in order of magnitude


def report_step(args, step, loss: float, seconds: float, recorder, layout, param_bytes: dict | None, bf16) -> None:
    """Rank 0: the step's global loss, wall clock, parameter bytes (rank 0's and the unsharded model's) and
    collectives per process group."""
    if dist.get_rank() != 0:
        return
    kinds = ("tp", "cp", "pp", "dp", "dp_cp") if layout.size("cp") > 1 else ("tp", "pp", "dp")
    groups = recorder.summary_by_group(layout.group_kind, kinds=kinds) if recorder.on else {}
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


def precision(bf16: bool, dp_sharding: str) -> str:
    """The dtypes a run keeps, said in one line."""
    if not bf16:
        return "fp32 parameters, gradients and optimizer"
    if dp_sharding in FSDP:
        policy = "MixedPrecision" if dp_sharding == "fsdp" else "MixedPrecisionPolicy"
        return f"bf16 compute over fp32 shards, gradients reduce-scattered in fp32 ({FSDP[dp_sharding]}'s {policy})"
    return "bf16 parameters and compute, fp32 main grads and fp32 master weights (Megatron's mixed precision)"


def state_bytes(model, optimizer, fsdp: bool) -> dict[str, int]:
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


def report_memory(args, ranks: list[dict]) -> None:
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


def replayed(stages: list[dict], chunks: int, v_shape: bool = False) -> float | None:
    """Sets each stage's idle fraction when the recorded orders are replayed with transfers free: with equal
    stages (equal_stages_bubble, the schedule's own) and at each action's recorded FLOPs at MODELED_TFLOPS
    (modeled_bubble). Returns the modeled step's seconds; None, and no modeled_bubble, when no FLOPs were
    recorded (the recorder is off on a torch it cannot hook). `v_shape`: the chunks lie in a V (zbv,
    dualpipev)."""
    orders = [s["actions"] for s in stages]
    for s, idle in zip(stages, idle_fractions(replay(orders, uniform_costs(orders, chunks), chunks, v_shape))):
        s["equal_stages_bubble"] = idle
    if not all(sum(s["action_flops"]) for s in stages):
        for s in stages:
            s["modeled_bubble"] = None
        return None
    seconds = [[flops / (MODELED_TFLOPS * 1e12) for flops in s["action_flops"]] for s in stages]
    spans = replay(orders, seconds, chunks, v_shape)
    for s, idle in zip(stages, idle_fractions(spans)):
        s["modeled_bubble"] = idle
    return max(end for stage in spans for _, end in stage)


def wall_clock(device: torch.device) -> str:
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


def report_pipeline(args, stages: list[dict], device: torch.device) -> None:
    """Rank 0: each stage's last step (actions, in-flight peak, bubble three ways), from the gathered meters."""
    p, m, v_shape = len(stages), args.micro_batches, args.schedule in V_SCHEDULES
    v = 2 if v_shape else args.virtual_stages
    step = replayed(stages, v, v_shape)
    if args.json:
        print(json.dumps({"pipeline": stages, "modeled_tflops": MODELED_TFLOPS, "modeled_step_s": step}), flush=True)
        return
    if p == 1:  # no stages to wait on each other: nothing idles
        print(f"pipeline: none (pp 1); {m} micro-batches accumulated per step", flush=True)
        print(f"  last step: {' '.join(stages[0]['actions'])}", flush=True)
        return
    zero_bubble = args.schedule in ZERO_BUBBLE_SCHEDULES
    name = f"interleaved 1f1b, {v} chunks per stage" if v > 1 and not v_shape else args.schedule
    name += ", two stages per rank in a V" if v_shape else ""
    unit, formula = ("chunk-forwards", "(p-1)/(v m+p-1)") if v > 1 else ("micro-batches", "(p-1)/(m+p-1)")
    if zero_bubble:
        formula = "(p-1)/(6m+p-1)" if v_shape else "(p-1)/(3m+p-1)"
    costs = "a forward costing 1 and a backward 2"
    if zero_bubble:
        costs = "a forward, an input gradient and a weight gradient costing 1 each"
    at_flops = (
        "not available, no FLOPs were recorded (the collective recorder is off)"
        if step is None
        else f"the same replay, each action its recorded FLOPs at {MODELED_TFLOPS:g} TFLOP/s: {step * 1e6:.2f} us a "
        "step; the stages differ (the last also runs the LM head and loss)"
    )
    header = [
        f"pipeline: {name}, pp {p}, {m} micro-batches (last step, one rank per "
        "stage); bubble: the fraction of the step a stage idles",
        f"  with equal stages: the recorded orders replayed, {costs}, transfers free: "
        f"the schedule's own; formula {formula} = {stages[0]['bubble_formula']:.2f}",
        f"  at its FLOPs: {at_flops}",
        f"  wall clock: {wall_clock(device)}",
    ]
    print("\n".join(header), flush=True)
    for s in stages:
        expected = peak_in_flight_formula(args.schedule, p, s["pp_rank"], m, v)
        if zero_bubble:  # what 1F1B would hold, in the same unit; and what the deferred W's held
            one_f_one_b = peak_in_flight_formula("1f1b", p, s["pp_rank"], m) * (2 if v_shape else 1)
            expected = f"{expected}, 1f1b's {one_f_one_b}; inputs held for W at most {s['peak_weight_grad_bytes']} B"
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

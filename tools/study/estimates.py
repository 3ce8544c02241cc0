"""The connect-the-dots numbers: measured quantities from a recorded run, scaled under stated assumptions.

Measured (from the trace): bytes of each collective, how many per block or unit, forward FLOPs (torch's
FlopCounterMode). Assumed (written in the note, passed as arguments): link bandwidth, FLOP rate, group size,
bytes per element. Collective time uses ring algorithms: an all-reduce puts 2(p-1)/p of its bytes on each
rank's link, an all-gather (p-1)/p. No overlap is assumed unless said.

The training-memory formulas (`training_memory`, `sharding_limit`) need no trace: bytes per parameter times
parameters, divided by the group under FSDP; tests/evidence/test_fsdp1_upstream_claims.py checks them
against the bytes torch DDP and FSDP1 hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from study.traces import RECORD, TraceError, events_where, pipeline_slots


@dataclass(frozen=True)
class TPCrossover:
    allreduce_bytes: int  # measured, one all-reduce at the first traced hidden size
    formula_bytes: int  # b * s * h * dtype_size at that size
    allreduces_per_block: int  # measured, forward and backward of one step
    hidden: int  # first traced hidden size
    flops_per_rank: int  # measured forward+backward FLOPs of the block per rank at `hidden`
    crossover_hidden: int  # h at which compute time equals all-reduce time under the assumptions


def tp_crossover(
    trace: dict, *, link_GBps: float, tflops: float, tp: int, bytes_per_element: int, block: str = "layers.0"
) -> TPCrossover:
    """Hidden size above which one TP block's training step (forward + backward) spends longer in GEMMs than
    in its all-reduces, with no overlap.

    From two traced hidden sizes h1 < h2: per-rank step FLOPs F(h) = a h^2 + c h (GEMMs grow like h^2,
    attention scores like h at fixed s) and all-reduce bytes n h. Rescaled to `tp` ranks (FLOPs split p ways)
    and `bytes_per_element`, compute a h^2 / R equals communication 2(p-1)/p n h / B at h = (2(p-1)/p n R/B - c)/a.
    """
    (r1, r2), p0 = trace["runs"][:2], trace["tp"]
    sums = []
    for run in (r1, r2):
        reduces = [e for e in events_where(run["events"], op="all_reduce") if e["module"].startswith(block + ".")]
        if not reduces:
            raise TraceError(f"trace {trace['name']}: no all-reduce recorded in {block}; {RECORD}")
        sums.append((len(reduces), sum(e["nbytes"] for e in reduces), reduces[0]["nbytes"]))
    (count, bytes1, one), (_, bytes2, _) = sums
    h1, h2 = r1["h"], r2["h"]
    if bytes1 * h2 != bytes2 * h1:
        raise TraceError(f"trace {trace['name']}: all-reduce bytes do not grow linearly with h; {RECORD}")
    f1, f2 = r1["step_flops_per_rank"] / h1, r2["step_flops_per_rank"] / h2
    a = (f2 - f1) / (h2 - h1) * p0 / tp
    c = (f1 - a * tp / p0 * h1) * p0 / tp
    n = bytes1 / h1 * bytes_per_element / trace["dtype_size"]
    wire = 2 * (tp - 1) / tp * n
    crossover = (wire * tflops * 1e12 / (link_GBps * 1e9) - c) / a
    return TPCrossover(
        one, trace["b"] * trace["s"] * h1 * trace["dtype_size"], count, h1, r1["step_flops_per_rank"], round(crossover)
    )


# Bytes per parameter a data-parallel rank keeps for mixed-precision or fp32 Adam training, activations aside:
# the fp32 weight, its gradient, and Adam's two fp32 moments (exp_avg, exp_avg_sq).
TRAINING_BYTES = {"params": 4, "grads": 4, "optimizer": 8}


@dataclass(frozen=True)
class TrainingMemory:
    params: float  # bytes per rank
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def training_memory(params: int, *, world: int, sharded: bool) -> TrainingMemory:
    """Per-rank bytes of weights, gradients and Adam states between steps: DDP keeps all of them on every rank,
    FSDP (FULL_SHARD) 1/world of each (the padding to world equal shards and the unit gathered at the
    moment aside)."""
    share = 1 / world if sharded else 1
    return TrainingMemory(*(params * TRAINING_BYTES[part] * share for part in ("params", "grads", "optimizer")))


@dataclass(frozen=True)
class ShardingLimit:
    gpu_GB: float  # assumed memory of one GPU
    world: int  # assumed FSDP group size
    bytes_per_param: int  # sum of TRAINING_BYTES
    ddp_max_billions: float  # largest model (billions of parameters) whose training states fit one GPU under DDP
    fsdp_max_billions: float  # the same, sharded over `world` ranks
    billions: list[float]  # model sizes to chart: 0 to the FSDP limit in steps of the DDP one, evenly spaced
    ddp_GB: list[float]  # per-rank training states at each size
    fsdp_GB: list[float]


def sharding_limit(*, gpu_GB: float, world: int) -> ShardingLimit:
    """Where weights, gradients and Adam states stop fitting one GPU: P = memory / 16 bytes under DDP, world
    times more under FSDP (decimal GB; activations, buffers and the gathered unit need the rest)."""
    per_param = sum(TRAINING_BYTES.values())
    ddp_max, fsdp_max = gpu_GB / per_param, gpu_GB * world / per_param
    billions = [round(k * ddp_max, 6) for k in range(world + 1)]  # equal steps: a categorical axis stays linear

    def per_rank_GB(sharded: bool) -> list[float]:
        return [round(training_memory(b * 1e9, world=world, sharded=sharded).total / 1e9, 2) for b in billions]

    return ShardingLimit(
        gpu_GB, world, per_param, round(ddp_max, 2), round(fsdp_max, 2), billions, per_rank_GB(False), per_rank_GB(True)
    )


@dataclass(frozen=True)
class PipelineMemory:
    pp: int  # recorded pipeline: stages and micro-batches
    m: int
    gpipe_peaks: list[int]  # measured per stage: micro-batches autograd kept alive at the peak
    one_f_one_b_peaks: list[int]
    first_stage_bytes_ratio: float  # measured: 1F1B's peak activation bytes on stage 0 over GPipe's
    bubble: float  # idle fraction of both recorded timelines, in slots (traces.pipeline_slots)
    bubble_formula: float  # (p - 1) / (m + p - 1)
    message_bytes: int  # measured: every send of the recorded step (all the same size)
    formula_bytes: int  # b * s * h * dtype_size
    scale_pp: int  # the scale trace's layout
    scale_m: int
    scale_message_bytes: int  # its point-to-point sends, per message (recorded on a middle stage)
    scale_first_stage_1f1b: int  # micro-batches in flight on stage 0 at that layout: 1F1B min(p, m), GPipe m
    scale_bubble: float  # (p - 1) / (m + p - 1) at that layout


def pipeline_bubble(trace: dict) -> float:
    """The idle fraction of a recorded pipeline step with equal stages: its recorded orders replayed in slots
    (traces.pipeline_slots: a forward 1, a backward 2, its I and W halves 1 each, transfers
    free), the schedule's own bubble, to set
    beside (p - 1) / (v m + p - 1). What the demo prints as "with equal stages"."""
    slots = pipeline_slots(trace)
    end = max(stage[-1][2] for stage in slots)
    busy = sum(stop - start for stage in slots for _, start, stop in stage)
    return 1 - busy / (end * len(slots))


def pipeline_memory(gpipe: dict, one_f_one_b: dict, scale: dict) -> PipelineMemory:
    """The numbers of the 1F1B note: in-flight peaks and bubble from the recorded GPipe and 1F1B steps,
    the size of a point-to-point message there and in the scale trace (a middle stage's sends)."""
    if (gpipe["pp"], gpipe["m"]) != (one_f_one_b["pp"], one_f_one_b["m"]):
        raise TraceError(f"traces {gpipe['name']} and {one_f_one_b['name']} ran different pipelines; {RECORD}")
    p, m = gpipe["pp"], gpipe["m"]
    sends = {
        e["nbytes"] for trace in (gpipe, one_f_one_b) for st in trace["stages"] for e in st["p2p"] if e["op"] == "send"
    }
    if len(sends) != 1:
        raise TraceError(f"trace {gpipe['name']}: sends of sizes {sorted(sends)}, expected one size; {RECORD}")
    bubbles = {round(pipeline_bubble(trace), 9) for trace in (gpipe, one_f_one_b)}
    if len(bubbles) != 1:
        raise TraceError(f"traces {gpipe['name']} and {one_f_one_b['name']} idle for different fractions; {RECORD}")
    setup = scale["setup"]
    rows = [
        row for row in scale["runs"][len(scale["runs"]) // 2]["rows"] if row["group"] == "pp" and row["op"] == "send"
    ]
    if not rows or not rows[0]["count"]:
        raise TraceError(f"trace {scale['name']}: no point-to-point send on a middle stage; re-record it")
    sp, sm = setup["pp"], setup["microbatches"]
    return PipelineMemory(
        pp=p,
        m=m,
        gpipe_peaks=[st["peak_in_flight_measured"] for st in gpipe["stages"]],
        one_f_one_b_peaks=[st["peak_in_flight_measured"] for st in one_f_one_b["stages"]],
        first_stage_bytes_ratio=one_f_one_b["stages"][0]["peak_activation_bytes"]
        / gpipe["stages"][0]["peak_activation_bytes"],
        bubble=bubbles.pop(),
        bubble_formula=(p - 1) / (m + p - 1),
        message_bytes=sends.pop(),
        formula_bytes=gpipe["b"] * gpipe["s"] * gpipe["h"] * gpipe["dtype_size"],
        scale_pp=sp,
        scale_m=sm,
        scale_message_bytes=rows[0]["bytes"] // rows[0]["count"],
        scale_first_stage_1f1b=min(sp, sm),
        scale_bubble=(sp - 1) / (sm + sp - 1),
    )

"""The connect-the-dots numbers: measured quantities from a recorded run, scaled under stated assumptions.

Measured (from the trace): bytes of each collective, how many per block or unit, forward FLOPs (torch's
FlopCounterMode). Assumed (written in the note, passed as arguments): link bandwidth, FLOP rate, group size,
bytes per element. Collective time uses ring algorithms: an all-reduce puts 2(p-1)/p of its bytes on each
rank's link, an all-gather (p-1)/p. No overlap is assumed unless said.
"""
from __future__ import annotations

from dataclasses import dataclass

from pin_and_cite.traces import RECORD, TraceError, events_where, pipeline_slots


@dataclass(frozen=True)
class TPCrossover:
    allreduce_bytes: int        # measured, one all-reduce at the first traced hidden size
    formula_bytes: int          # b * s * h * dtype_size at that size
    allreduces_per_block: int   # measured, forward and backward of one step
    hidden: int                 # first traced hidden size
    flops_per_rank: int         # measured forward+backward FLOPs of the block per rank at `hidden`
    crossover_hidden: int       # h at which compute time equals all-reduce time under the assumptions


def tp_crossover(trace: dict, *, link_GBps: float, tflops: float, tp: int, bytes_per_element: int,
                 block: str = "layers.0") -> TPCrossover:
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
    return TPCrossover(one, trace["b"] * trace["s"] * h1 * trace["dtype_size"], count, h1,
                       r1["step_flops_per_rank"], round(crossover))


@dataclass(frozen=True)
class FSDPOverlap:
    params: int                     # measured parameter count of the traced model
    forward_allgather_bytes: int    # measured: all forward all-gathers of one step, full (gathered) sizes
    flops_per_token: float          # measured forward FLOPs per token of the unsharded model
    param_bytes_per_rank: int       # measured: padded shards, this world size
    param_bytes_unsharded: int
    tokens_to_hide: int             # tokens per rank per step at which forward compute covers the all-gathers


def fsdp_overlap(trace: dict, *, link_GBps: float, tflops: float, world: int, bytes_per_element: int) -> FSDPOverlap:
    """Tokens per rank per step above which FSDP's forward all-gathers (prefetched one unit ahead) can hide
    behind forward compute: (p-1)/p G / B = T f / R, where G is all-gathered bytes per forward, f FLOPs per
    token. Both G and f grow with the parameter count, so the answer barely depends on model size."""
    gathered = sum(e["nbytes"] for e in events_where(trace["events"], op="all_gather", phase="forward"))
    if not gathered:
        raise TraceError(f"trace {trace['name']}: no forward all-gather recorded; {RECORD}")
    wire = (world - 1) / world * gathered * bytes_per_element / trace["dtype_size"]
    tokens = wire / (link_GBps * 1e9) * tflops * 1e12 / trace["forward_flops_per_token"]
    padded = sum(u["padded_numel"] for u in trace["units"]) * trace["dtype_size"]
    return FSDPOverlap(trace["params"], gathered, trace["forward_flops_per_token"], padded // trace["world"],
                       trace["params"] * trace["dtype_size"], round(tokens))


@dataclass(frozen=True)
class PipelineMemory:
    pp: int                          # recorded pipeline: stages and micro-batches
    m: int
    gpipe_peaks: list[int]           # measured per stage: micro-batches autograd kept alive at the peak
    one_f_one_b_peaks: list[int]
    first_stage_bytes_ratio: float   # measured: 1F1B's peak activation bytes on stage 0 over GPipe's
    bubble: float                    # idle fraction of both recorded timelines, in slots (traces.pipeline_slots)
    bubble_formula: float            # (p - 1) / (m + p - 1)
    message_bytes: int               # measured: every send of the recorded step (all the same size)
    formula_bytes: int               # b * s * h * dtype_size
    scale_pp: int                    # the scale trace's layout
    scale_m: int
    scale_message_bytes: int         # its point-to-point sends, per message (recorded on a middle stage)
    scale_first_stage_1f1b: int      # micro-batches in flight on stage 0 at that layout: 1F1B min(p, m), GPipe m
    scale_bubble: float              # (p - 1) / (m + p - 1) at that layout


def _idle(trace: dict) -> float:
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
    sends = {e["nbytes"] for trace in (gpipe, one_f_one_b) for st in trace["stages"] for e in st["p2p"]
             if e["op"] == "send"}
    if len(sends) != 1:
        raise TraceError(f"trace {gpipe['name']}: sends of sizes {sorted(sends)}, expected one size; {RECORD}")
    bubbles = {round(_idle(trace), 9) for trace in (gpipe, one_f_one_b)}
    if len(bubbles) != 1:
        raise TraceError(f"traces {gpipe['name']} and {one_f_one_b['name']} idle for different fractions; {RECORD}")
    setup = scale["setup"]
    rows = [row for row in scale["runs"][len(scale["runs"]) // 2]["rows"] if row["group"] == "pp"
            and row["op"] == "send"]
    if not rows or not rows[0]["count"]:
        raise TraceError(f"trace {scale['name']}: no point-to-point send on a middle stage; re-record it")
    sp, sm = setup["pp"], setup["microbatches"]
    return PipelineMemory(
        pp=p, m=m, gpipe_peaks=[st["peak_in_flight_measured"] for st in gpipe["stages"]],
        one_f_one_b_peaks=[st["peak_in_flight_measured"] for st in one_f_one_b["stages"]],
        first_stage_bytes_ratio=one_f_one_b["stages"][0]["peak_activation_bytes"]
        / gpipe["stages"][0]["peak_activation_bytes"],
        bubble=bubbles.pop(), bubble_formula=(p - 1) / (m + p - 1), message_bytes=sends.pop(),
        formula_bytes=gpipe["b"] * gpipe["s"] * gpipe["h"] * gpipe["dtype_size"], scale_pp=sp, scale_m=sm,
        scale_message_bytes=rows[0]["bytes"] // rows[0]["count"], scale_first_stage_1f1b=min(sp, sm),
        scale_bubble=(sp - 1) / (sm + sp - 1))

"""A recorded step on a modeled time scale: each span's compute from its recorded FLOPs at a stated FLOP rate,
each collective's and message's time from its recorded bytes at a stated link bandwidth, in the recorded order.

Times of the CPU/gloo runs say nothing about a GPU; FLOPs, bytes and order are what the reference did, so the
step is re-timed as a GPU at `Rates` would run it, keeping every dependency the recording shows:
  * FSDP (`fsdp_modeled`): one compute stream and one collective stream. Walking the recorded collectives and
    compute spans in recorded order, compute advances by the FLOPs recorded between two points (at the rate of
    the later point's phase, where forward and backward rates differ); a collective
    is issued at that compute time and runs when the collective stream is free, for the bytes a rank sends
    on a ring (scale_tables.sent_bytes); a unit's compute starts no earlier than its all-gather's end. A
    backward span runs to the unit's post-backward hook, which autograd may fire after other units computed:
    its bar ends where a unit it does not hold (by the nesting of the forward spans) starts. Every bar sits on
    its unit's row, collectives too.
  * pipelines (`pipeline_modeled`): each stage runs its actions in the recorded order, each action its
    recorded FLOPs, a forward after the previous stage's forward of that micro-batch and its activation's
    transfer, a backward after the next stage's backward and the gradient's transfer (traces.pipeline_schedule).
`*_measured` give the same bars from a trace's own recorded times (a CUDA run, where a device recorded one).
"""

from __future__ import annotations

from dataclasses import dataclass

from study.estimates import pipeline_bubble
from study.scale_tables import sent_bytes
from study.timeline import Bar
from study.traces import RECORD, TraceError, events_where, pipeline_schedule

FSDP_COLORS = {
    "forward compute": "#1565c0",
    "backward compute": "#6a1b9a",
    "all-gather": "#2e7d32",
    "reduce-scatter": "#ef6c00",
}
# a shade per model chunk (one for 1F1B and GPipe); the demo and the traces name an action F<c>.<i> (chunk c,
# micro-batch i; reference.pipeline.steps), or F<i> without chunks
CHUNK_SHADES = {
    "forward": ("#1565c0", "#00838f", "#283593", "#2e7d32"),
    "backward": ("#6a1b9a", "#ad1457", "#4e342e", "#c62828"),
    "input gradient": ("#7b1fa2", "#c2185b", "#5d4037", "#b71c1c"),  # zero bubble: a backward's I half
    "weight gradient": ("#e65100", "#9e6a00", "#bf360c", "#827717"),  # and its W half
}
PHASES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}  # by an action's letter
COLLECTIVES = {"all_gather": ("all-gather", "AG"), "reduce_scatter": ("reduce-scatter", "RS")}


@dataclass(frozen=True)
class Rates:
    tflops: float  # dense FLOP rate of one GPU, TFLOP/s (forward, and backward unless backward_tflops says)
    link_GBps: float  # what one rank sends per second, GB/s
    backward_tflops: float | None = None
    measured_on: str | None = None  # "device, torch, dtype" that measured them (study.calibration)

    def __post_init__(self):
        rates = (self.tflops, self.link_GBps, self.backward_tflops or self.tflops)
        if not all(isinstance(rate, (int, float)) and rate > 0 for rate in rates):
            raise TraceError(
                f"a modeled timeline needs positive tflops and link_GBps, not {self.tflops!r} and {self.link_GBps!r}"
            )

    @property
    def axis(self) -> str:
        if self.measured_on is None:
            return f"modeled at {self.tflops:g} TFLOP/s, {self.link_GBps:g} GB/s"
        return f"modeled at the rates of {self.measured_on}, {self.link_GBps:g} GB/s"

    def compute(self, flops: float, phase: str = "forward") -> float:
        rate = self.backward_tflops if phase == "backward" and self.backward_tflops else self.tflops
        return flops / (rate * 1e12)

    def transfer(self, nbytes: float) -> float:
        return nbytes / (self.link_GBps * 1e9)


def _stamped(trace: dict) -> list[tuple[float, int, str, dict]]:
    """The FSDP trace's points in recorded order: (time, FLOPs computed before it, what, event or span)."""
    if any("flops" not in e for e in trace["events"]) or any("flops_end" not in s for s in trace["spans"]):
        raise TraceError(
            f"trace {trace['name']}: its collectives and spans carry no FLOP counts, which the "
            f"modeled timeline needs; {RECORD}"
        )
    points = [(e["start"], e["flops"], "issue", e) for e in trace["events"] if e["op"] in COLLECTIVES]
    points += [(s["start"], s["flops_start"], "start", s) for s in trace["spans"]]
    points += [(s["end"], s["flops_end"], "end", s) for s in trace["spans"]]
    return sorted(points, key=lambda p: (p[0], p[1]))


def _compute_bar(span: dict, start: float, end: float, ended_by: tuple[str, int] | None = None) -> Bar:
    """`ended_by`: (the unit whose start ended this compute, FLOPs done then), where the span ran on to a later
    post-backward hook."""
    unit, phase = span["name"].rsplit(" ", 1)
    if ended_by is None:
        detail = f"{span['flops_end'] - span['flops_start']:,} FLOPs (with the units it holds)"
    else:
        detail = (
            f"{ended_by[1] - span['flops_start']:,} FLOPs, until {ended_by[0]} started; its post-backward hook "
            f"fired later, {span['flops_end']:,} FLOPs into the step"
        )
    return Bar(unit, f"{phase} compute", f"{unit} {phase}", start, end, detail)


def _collective_bar(trace: dict, event: dict, start: float, end: float) -> Bar:
    kind, short = COLLECTIVES[event["op"]]
    return Bar(
        event["module"],
        kind,
        f"{short} {event['module']}",
        start,
        end,
        f"{kind} of {event['module']}, {event['phase']}, {event['nbytes']:,} B gathered or reduced, "
        f"{sent_bytes(event['op'], event['nbytes'], trace['world']):,} B sent by a rank",
        short=short,
    )


def _holds(trace: dict) -> set[tuple[str, str]]:
    """(outer, inner) units whose recorded forward spans nest: the root holds the layers."""
    forward = {s["name"].rsplit(" ", 1)[0]: (s["start"], s["end"]) for s in trace["spans"] if s["phase"] == "forward"}
    return {
        (a, b) for a, (a0, a1) in forward.items() for b, (b0, b1) in forward.items() if a != b and a0 <= b0 <= b1 <= a1
    }


def fsdp_modeled(trace: dict, rates: Rates) -> list[Bar]:
    """The FSDP step's compute spans and collectives, re-timed (see the module docstring)."""
    clock = flops_done = stream_free = 0.0
    gathered: dict[str, float] = {}  # unit -> modeled end of its latest all-gather
    started: dict[int, tuple[float, dict]] = {}  # open spans: id -> (modeled start, span)
    holds = _holds(trace)
    bars = []
    for _, flops, what, item in _stamped(trace):
        clock += rates.compute(max(0, flops - flops_done), item["phase"])
        flops_done = max(flops_done, flops)
        if what == "issue":
            start = max(clock, stream_free)
            stream_free = start + rates.transfer(sent_bytes(item["op"], item["nbytes"], trace["world"]))
            if item["op"] == "all_gather":
                gathered[item["module"]] = stream_free
            bars.append(_collective_bar(trace, item, start, stream_free))
        elif what == "start":
            unit = item["name"].rsplit(" ", 1)[0]
            for key, (begun, span) in list(started.items()):  # one compute stream: theirs ended here
                if (span["name"].rsplit(" ", 1)[0], unit) not in holds:
                    bars.append(_compute_bar(span, begun, clock, (unit, flops)))
                    del started[key]
            clock = max(clock, gathered.get(unit, 0.0))
            started[id(item)] = (clock, item)
        elif id(item) in started:
            bars.append(_compute_bar(item, started.pop(id(item))[0], clock))
    return bars


def fsdp_measured(trace: dict) -> list[Bar]:
    """The same bars at the trace's own recorded times (seconds from its first record)."""
    bars = [_compute_bar(s, s["start"], s["end"]) for s in trace["spans"]]
    return bars + [
        _collective_bar(trace, e, e["start"], e["end"] if e["end"] is not None else e["start"])
        for e in trace["events"]
        if e["op"] in COLLECTIVES
    ]


def pipeline_colors(trace: dict) -> dict[str, str]:
    """Legend entry -> colour: each kind of action the trace ran (forward and backward, or a zero-bubble
    backward's I and W halves), per model chunk under interleaving or in a V."""
    chunks = trace.get("virtual_stages", 1)
    if chunks > len(CHUNK_SHADES["forward"]):
        raise TraceError(f"trace {trace['name']}: {chunks} chunks per stage, more than the timeline has colours for")
    ran = {action[0] for st in trace["stages"] for action in st["actions"]}
    phases = [phase for letter, phase in PHASES.items() if letter in ran]
    if chunks == 1:
        return {phase: CHUNK_SHADES[phase][0] for phase in phases}
    return {f"{phase}, chunk {c}": CHUNK_SHADES[phase][c] for phase in phases for c in range(chunks)}


def pipeline_note(trace: dict) -> str:
    """How to read a block: its number is the micro-batch; the demo's name for it. Then the step's bubble with
    equal stages (traces.pipeline_slots) and each stage's peak in flight, as recorded."""
    if trace.get("v_shape"):
        how = "Number: the micro-batch. F1.0 = forward of chunk 1 (back up the V), micro-batch 0."
    elif trace.get("virtual_stages", 1) > 1:
        how = "Number: the micro-batch. The demo prints F<c>.<i>: F1.0 = forward of chunk 1, micro-batch 0."
    else:
        how = "Number: the micro-batch. The demo prints F<i> and B<i>: F0 = forward of micro-batch 0."
    peaks = ", ".join(str(st["peak_in_flight_measured"]) for st in trace["stages"])
    unit = " chunk-forwards" if trace.get("virtual_stages", 1) > 1 else ""
    return f"{how}\nBubble with equal stages {pipeline_bubble(trace):.2f}; peak in flight, stage 0 on: {peaks}{unit}."


def _pipeline_bar(r: int, action: str, start: float, end: float, flops: int) -> Bar:
    phase = PHASES[action[0]]
    chunk, _, micro_batch = action[1:].rpartition(".")
    kind = f"{phase}, chunk {chunk}" if chunk else phase
    return Bar(f"stage {r}", kind, action, start, end, f"{flops:,} FLOPs", short=micro_batch)


def pipeline_modeled(trace: dict, rates: Rates) -> list[Bar]:
    """The pipeline step re-timed (see the module docstring)."""
    stages = trace["stages"]
    if any(len(st.get("action_flops", ())) != len(st["actions"]) for st in stages):
        raise TraceError(
            f"trace {trace['name']}: its pipeline actions carry no FLOP counts, which the modeled "
            f"timeline needs; {RECORD}"
        )
    message = trace["dtype_size"]
    for size in trace["activation_shape"]:
        message *= size
    placed = pipeline_schedule(
        trace,
        lambda r, i, action: rates.compute(stages[r]["action_flops"][i], "forward" if action[0] == "F" else "backward"),
        lambda r, action: rates.transfer(message),
    )
    return [
        _pipeline_bar(r, action, start, end, stages[r]["action_flops"][i])
        for r, stage in enumerate(placed)
        for i, (action, start, end) in enumerate(stage)
    ]


def pipeline_measured(trace: dict) -> list[Bar]:
    return [
        _pipeline_bar(r, action, start, end, st.get("action_flops", [0] * len(st["actions"]))[i])
        for r, st in enumerate(trace["stages"])
        for i, (action, (start, end)) in enumerate(zip(st["actions"], st["action_spans"]))
    ]


def check_collectives_recorded(trace: dict) -> None:
    """Every unit has a forward all-gather and a forward span: otherwise the timeline would be silently partial."""
    units = [u["name"] for u in trace["units"]]
    spans = {s["name"] for s in trace["spans"]}
    gathered = {e["module"] for e in events_where(trace["events"], op="all_gather", phase="forward")}
    missing = [u for u in units if u not in gathered or f"{u} forward" not in spans]
    if missing:
        raise TraceError(
            f"trace {trace['name']}: no forward all-gather or compute span recorded for unit(s) "
            f"{', '.join(missing)}; cannot draw the FSDP timeline; {RECORD}"
        )

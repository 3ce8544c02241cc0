"""Recorded runs of the reference implementation, as the notes read them: reading_notes/traces/NAME.json.

`tools/record-traces` writes them (tools/trace_worker.py under torchrun, with reference.measure.recorder's
CollectiveRecorder). A note reads one with `trace("tp_block")`; `diagram()` and the connect-the-dots numbers
are computed from it, never typed. A trace that is missing, malformed, or lacks what a reader asks of it is a
one-line error naming the file and saying how to re-record it.

`structure()` is what a committed trace must share with a fresh run (tests/tools/test_traces.py): operations,
their order, shapes, bytes, FLOP counts (each collective and span stamped with the FLOPs computed before
it, each pipeline action with its own), and the order of issue versus compute, but not timings. For a
pipeline trace: each stage's action order, in-flight peaks, activation bytes (and, zero bubble, the bytes held
for W), and its sends and receives.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

from pin_and_cite.core.bounded import parse, read_file
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.fences import page_text

TRACE_DIR = "traces"
MAX_BYTES = 16 << 20  # the largest recorded trace (layout_grid) holds 395 KB
RECORD = "re-record with tools/record-traces"
REQUIRED = {
    "tp_block": ("world", "tp", "s", "b", "heads", "kv_heads", "style", "dtype_size", "runs"),
    "fsdp_forward": (
        "world",
        "params",
        "dtype_size",
        "tokens_per_rank",
        "s",
        "b",
        "h",
        "forward_flops_per_token",
        "units",
        "events",
        "spans",
    ),
    "scale": ("setup", "world", "runs"),  # python -m reference.measure.scale --json (study.scale_tables)
    "pipeline": ("schedule", "world", "pp", "m", "b", "s", "h", "dtype_size", "activation_shape", "stages"),
    "activation_memory": ("world", "shape", "configurations", "llama"),  # benchmarks/bench_activation_memory.py --json
    # python -m reference.measure.scale.grid (study.scale_calculator)
    "layout_grid": ("values", "initial", "fixed", "models", "held", "traffic", "state", "bubble", "cp"),
    # torchrun -m reference.hf_tp --json: PyTorch DTensor's plan on HF's Qwen2 (the DTensor walkthrough)
    "dtensor": ("world", "config", "sequence_parallel", "plan", "parameters", "collectives", "loss", "loss_unsharded"),
    # torchrun -m reference --moe --json: one MoE layer's steps, every rank's routing and collectives (the MoE
    # walkthrough; study.moe_figure)
    "moe": ("world", "config", "steps"),
    # torchrun -m reference.measure.cp_blocks --json: each cp rank's ring-attention blocks per ring step, without
    # and with head-tail balancing (the CP walkthrough; study.cp_figure)
    "cp_blocks": ("cp", "seq_length", "pairs_total", "runs"),
    # torchrun tools/fsdp_compare.py: PyTorch's FSDP1 and FSDP2 on one model (the FSDP1 ↔ FSDP2 page)
    "fsdp_compare": ("world", "config", "units", "parameters", "options", "runs", "state_dicts"),
}
PIPELINE_STAGE_KEYS = (
    "pp_rank",
    "actions",
    "action_flops",
    "peak_in_flight",
    "peak_in_flight_measured",
    "peak_activation_bytes",
    "peak_weight_grad_bytes",  # zero bubble; 0 for the other schedules (absent from their older traces)
)
SPAN_KEYS = ("name", "phase", "flops_start", "flops_end")
P2P_KEYS = ("op", "phase", "shape", "nbytes", "dtype", "group_ranks", "async_op")
# Slots each action takes on the pipeline timeline: a backward costs about twice a forward's FLOPs; split in two
# (zero bubble), its input gradient I and its weight gradient W take one slot each.
SLOTS = {"F": 1, "B": 2, "I": 1, "W": 1}
EVENT_KEYS = ("op", "module", "phase", "shape", "nbytes", "dtype", "group_ranks", "async_op")


class TraceError(PinAndCiteError):
    """A trace cannot give what was asked of it."""


def load_json(notes_dir: Path, folder: str, name: str, noun: str, fix: str, error=TraceError, loads=json.loads):
    """(data, text, where) of notes_dir/folder/NAME.json: a trace or a calibration (`noun`: "recorded trace",
    "calibration"); a bad name, a missing file or broken JSON is a one-line `error` that ends with `fix`."""
    if not name.replace("_", "").replace("-", "").isalnum():
        raise error(f"{noun.split()[-1]} name {name!r} must be letters, digits, '_' or '-'")
    path = notes_dir / folder / f"{name}.json"
    where = f"{notes_dir.name}/{folder}/{path.name}"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.json"))) or "none"
        raise error(f"no {noun} {name!r} ({where} is missing; {folder}: {known}); {fix}")
    try:
        text = read_file(path, MAX_BYTES, where, error)
        return parse(loads, text, where, error), text, where
    except ValueError as exc:
        raise error(f"{where} is not valid JSON ({exc}); {fix}") from None


def load_trace(notes_dir: Path, name: str) -> dict:
    """The trace `name`, checked to have the fields its kind needs."""
    data, text, where = load_json(notes_dir, TRACE_DIR, name, "recorded trace", RECORD)
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in REQUIRED:
        raise TraceError(f"{where}: unknown trace kind {kind!r} (known: {', '.join(REQUIRED)}); {RECORD}")
    missing = [key for key in REQUIRED[kind] if key not in data]
    if missing:
        raise TraceError(f"{where}: {kind} trace lacks {', '.join(missing)}; {RECORD}")
    data["name"] = name
    return page_text(data, text)


def events_where(events: list[dict], **match) -> list[dict]:
    return [e for e in events if all(e.get(k) == v for k, v in match.items())]


def forward_markers(trace: dict) -> list[tuple[str, str]]:
    """The FSDP forward as an ordered list of ("issue", unit) / ("start"|"end", unit): when each all-gather was
    issued relative to each unit's compute. Ordering, not time, so it must be the same in every run."""
    points = [
        (e["start"], "issue", e["module"]) for e in events_where(trace["events"], op="all_gather", phase="forward")
    ]
    for span in trace["spans"]:
        if span["phase"] == "forward":
            unit = span["name"].removesuffix(" forward")
            points += [(span["start"], "start", unit), (span["end"], "end", unit)]
    return [(what, unit) for _, what, unit in sorted(points)]


def pipeline_slots(trace: dict) -> list[list[tuple[str, int, int]]]:
    """Each stage's recorded actions as (action, first slot, end slot): pipeline_schedule with each action
    taking its SLOTS. Derived from the order alone, so every run that keeps the order draws the same timeline;
    wall times are not used."""
    return pipeline_schedule(trace, lambda r, i, action: SLOTS[action[0]])


def virtual_stage(trace: dict, r: int, chunk: int) -> int:
    """The stage of the whole pipeline that chunk `chunk` of rank r holds: c * p + r round the ring
    (interleaved), or, in a V (`v_shape`: zbv, dualpipev), r on the way down and 2p - 1 - r on the way back."""
    p = len(trace["stages"])
    if trace.get("v_shape"):
        return (r, 2 * p - 1 - r)[chunk]
    return chunk * p + r


def rank_of(trace: dict, virtual: int) -> int:
    p = len(trace["stages"])
    return virtual if not trace.get("v_shape") or virtual < p else 2 * p - 1 - virtual


def pipeline_schedule(trace: dict, duration, transfer=lambda r, action: 0) -> list[list[tuple[str, float, float]]]:
    """Each stage's recorded actions as (action, start, end): in the recorded order per stage, each as early as
    its inputs allow, all after the stage's previous action, the i-th action of stage r taking
    `duration(r, i, action)` and a message from another rank r arriving `transfer(r, action)` after the action
    that sent it ended. F i runs after F i on the stage before; a backward B i, or its input-gradient half I i
    (zero bubble), after F i on its own stage and B or I i on the stage after; the weight-gradient half W i
    after I i. Under interleaving (actions F<c>.<i>, chunk c of stage r) the stages before and after are
    virtual ones (virtual_stage), so chunk c + 1 of the first stage waits for chunk c of the last; in a V
    the turn, from stage p - 1 to p, stays on the last rank and costs no transfer."""
    stages = [st["actions"] for st in trace["stages"]]
    p, done = len(stages), {}
    placed: list[list[tuple[str, float, float]]] = [[] for _ in stages]
    last_virtual = p * trace.get("virtual_stages", 1) - 1
    waiting = deque(range(p))  # stages that may run their next action: all at first, then a neighbour's
    while waiting:
        r = waiting.popleft()
        actions = stages[r]
        while len(placed[r]) < len(actions):
            action = actions[len(placed[r])]
            kind, (chunk, _, micro_batch) = action[0], action[1:].rpartition(".")
            if kind not in SLOTS or not micro_batch.isdigit() or not (chunk or "0").isdigit():
                raise TraceError(
                    f"trace {trace['name']}: stage {r} ran {action!r}, not F, B, I or W followed by <i> or "
                    f"<c>.<i>; {RECORD}"
                )
            virtual = virtual_stage(trace, r, int(chunk or 0))
            done_as = "B" if kind == "I" else kind  # the stage before waits for I as it would for B
            ready = [placed[r][-1][2] if placed[r] else 0]
            if kind in "BI" and (virtual, "F", micro_batch) not in done:
                break  # a backward needs its own forward first: recorded out of order, it never runs
            if kind == "W":
                if (virtual, "B", micro_batch) not in done:
                    break
                needs = []
            else:
                peer = virtual - 1 if kind == "F" else virtual + 1
                needs = [(peer, done_as)] if 0 <= peer <= last_virtual else []
            for peer, peer_kind in needs:
                if (peer, peer_kind, micro_batch) not in done:
                    break
                sender = rank_of(trace, peer)
                ready.append(done[peer, peer_kind, micro_batch] + (0 if sender == r else transfer(sender, action)))
            else:
                start = max(ready)
                end = start + duration(r, len(placed[r]), action)
                placed[r].append((action, start, end))
                done[virtual, done_as, micro_batch] = end
                waiting.extend({(r - 1) % p, (r + 1) % p})  # only a neighbour can have waited on this action
                continue
            break
    if any(len(done_r) < len(actions) for done_r, actions in zip(placed, stages)):
        raise TraceError(
            f"trace {trace['name']}: the recorded action orders wait on each other (no stage can "
            f"run its next action); {RECORD}"
        )
    return placed


def _rows(events: list[dict], keys: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Each event's `keys`, as comparable JSON text."""
    return [tuple(json.dumps(e[k]) for k in keys) for e in events]


def structure(trace: dict) -> dict:
    """Everything of a trace that a fresh run must reproduce exactly."""
    if trace["kind"] == "pipeline":
        return {
            **{k: trace[k] for k in REQUIRED["pipeline"] if k != "stages"},
            "virtual_stages": trace.get("virtual_stages", 1),
            "v_shape": trace.get("v_shape", False),
            "stages": [
                {
                    **{k: st.get(k, 0) for k in PIPELINE_STAGE_KEYS},
                    "spans": len(st["action_spans"]),
                    "p2p": _rows(st["p2p"], P2P_KEYS),
                }
                for st in trace["stages"]
            ],
        }
    if trace["kind"] == "tp_block":
        return {
            **{k: trace[k] for k in REQUIRED["tp_block"] if k != "runs"},
            "runs": [
                {
                    "h": run["h"],
                    "step_flops_per_rank": run["step_flops_per_rank"],
                    "forward_steps": run["forward_steps"],
                    "events": _rows(run["events"], EVENT_KEYS),
                }
                for run in trace["runs"]
            ],
        }
    return {
        **{k: trace[k] for k in REQUIRED["fsdp_forward"] if k not in ("events", "spans")},
        "events": _rows(trace["events"], (*EVENT_KEYS, "flops")),
        "spans": _rows(trace["spans"], SPAN_KEYS),
        "forward_markers": forward_markers(trace),
    }

"""Compute rates a device measured (`python -m reference.measure.calibrate`), for the modeled timelines:
reading_notes/calibrations/NAME.json, drawn with `diagram(..., calibration="NAME", link_GBps=...)`.

The file holds, per block shape, each op's FLOPs and median seconds, forward and backward, and the block's
aggregate rate (its FLOPs over its seconds). A trace is re-timed at the aggregate rates of the block measured
at its own shapes, forward spans at the forward rate, backward spans at the backward one. Aggregate, not per
op: a span's FLOPs are one count over all the rank ran, not split by op, and the aggregate weights each op by
its share of the FLOPs, as that count does (an edge stage's embedding and head run at the block's rate). A
trace at shapes the file did not measure is an error, never a nearby rate.
"""

from __future__ import annotations

import json
from pathlib import Path

from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.fences import page_text
from pin_and_cite.core.schema import check
from study.modeled import Rates
from study.traces import RECORD, TraceError, load_json

CALIBRATION_DIR = "calibrations"
MEASURE = "measure one with python -m reference.measure.calibrate"
SIZE = {"type": "integer", "minimum": 1}
TEXT = {"type": "string", "maxLength": 200}


def _record(**properties) -> dict:
    return {"type": "object", "required": list(properties), "properties": properties, "additionalProperties": False}


MAX_TFLOPS = 1e6  # TFLOP/s no device comes near (an H200 does 1e3 in bf16): a rate past it is a broken file
MIN_TFLOPS = 1e-6  # a block's rate below it (1e-320 once) makes every span last forever


def _rate(tflops: dict) -> dict:
    return _record(
        flops={"type": "integer", "minimum": 0},
        seconds={
            "type": "number",
            "minimum": 1e-12,
            "maximum": 1e6,
            "description": "a positive number of seconds (1e-12 to 1e6)",
        },
        tflops=tflops,
    )


OP = _record(
    op=TEXT,
    phase={"enum": ["forward", "backward"]},
    shapes={"type": "array", "items": {"type": "array", "items": SIZE}},
    **_rate({"type": "number", "minimum": 0, "maximum": MAX_TFLOPS})["properties"],
)
BLOCK_RATE = _rate(
    {"type": "number", "minimum": MIN_TFLOPS, "maximum": MAX_TFLOPS, "description": "a positive TFLOP/s (1e-6 to 1e6)"}
)
BLOCK = _record(
    name=TEXT,
    style={"enum": ["gpt2", "llama"]},
    s=SIZE,
    b=SIZE,
    h=SIZE,
    heads=SIZE,
    kv_heads=SIZE,
    ffn=SIZE,
    tp=SIZE,
    ops={"type": "array", "items": OP},
    forward=BLOCK_RATE,
    backward=BLOCK_RATE,
)
CALIBRATION = _record(
    kind={"enum": ["calibration"]},
    version={"enum": [1]},
    device=TEXT,
    device_type=TEXT,
    torch=TEXT,
    cuda={"type": ["string", "null"], "maxLength": 200},
    dtype=TEXT,
    warmup={"type": "integer", "minimum": 0},
    repeats=SIZE,
    timing=TEXT,
    blocks={"type": "array", "items": BLOCK, "minItems": 1},
)
MATCHED = ("style", "tp", "s", "b", "h")  # what a trace's compute shares with the block measured for it


def _not_finite(constant: str):
    raise ValueError(f"{constant} is not a number a device measured")


def _finite_json(text):
    """JSON without Python's extensions NaN and Infinity (a NaN passes every bound a schema sets)."""
    return json.loads(text, parse_constant=_not_finite)


def load_calibration(notes_dir: Path, name: str) -> dict:
    """The calibration `name`, checked against CALIBRATION."""
    data, text, where = load_json(
        notes_dir, CALIBRATION_DIR, name, "calibration", MEASURE, PinAndCiteError, _finite_json
    )
    check(data, CALIBRATION, where, MEASURE)
    return page_text(data, text)


def trace_rates(trace: dict, link_GBps: float, tflops: float | None = None, calibration: dict | None = None) -> Rates:
    """The rates to re-time `trace` at: the stated `tflops`, or those `calibration` measured at its shapes."""
    if (tflops is None) == (calibration is None):
        raise TraceError(f"trace {trace['name']}: a modeled timeline takes tflops= or calibration=, one of them")
    if calibration is None:
        return Rates(tflops, link_GBps)
    shape = {"style": trace.get("style", "gpt2"), "tp": trace.get("tp", 1)}
    shape |= {key: trace[key] for key in ("s", "b", "h") if key in trace}
    if len(shape) < len(MATCHED):
        raise TraceError(f"trace {trace['name']} records no s, b and h to find its calibrated rate; {RECORD}")
    block = next((b for b in calibration["blocks"] if all(b[k] == shape[k] for k in MATCHED)), None)
    if block is None:
        wanted = ", ".join(f"{k} {shape[k]}" for k in MATCHED)
        raise TraceError(
            f"trace {trace['name']} ran {wanted}, which calibration {calibration['device']!r} did not measure; "
            f"{MEASURE} (its blocks are the traces' shapes)"
        )
    return Rates(
        block["forward"]["tflops"],
        link_GBps,
        backward_tflops=block["backward"]["tflops"],
        measured_on=f"{calibration['device']}, torch {calibration['torch']}, {calibration['dtype']}",
    )

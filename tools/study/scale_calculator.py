"""The Scale page's calculator: controls for a layout, and the grid of closed forms it looks the layout up in.

`scale_calculator(trace("layout_grid"))` gives the HTML: a form of the grid's values (model, TP, CP, PP, DP, micro-
batches, sequence parallelism, distributed optimizer), set to `python -m reference.measure.scale`'s defaults, an
empty result that docs/javascripts/scale_calculator.js fills (at CP > 1 the ring-attention rows of `--cp`, from
the grid's "cp" table, whose models, such as the 405B-like one, join the model list), and the grid itself, which
a script element hands to the calculator's element as its `scaleGrid` (the page needs no second request,
material's search skips script elements, and material's instant navigation runs a page's inline scripts again,
where a JSON script element would lose its type and be run as JavaScript). The grid is
reading_notes/traces/layout_grid.json (`python -m reference.measure.scale.grid`, recorded by tools/record-traces):
the numbers come from reference.measure.scale.formulas when it was recorded, never from this package, which
imports neither the reference nor torch.
"""

from __future__ import annotations

import json
from html import escape

from study.traces import RECORD, TraceError

CONTROLS = (  # grid field, label, CLI flag
    ("model", "Model", "--model"),
    ("tp", "TP size", "--tp"),
    ("cp", "CP size", "--cp"),  # the grid's "cp" table: its values and initial value are its own
    ("pp", "PP size p", "--pp"),
    ("dp", "DP size", "--dp"),
    ("microbatches", "Micro-batches m", "--micro-batches"),
)
SWITCHES = (
    ("sp", "sequence parallelism", "--sequence-parallel"),
    ("distributed_optimizer", "distributed optimizer", "--dp-sharding optimizer"),
)


def _model_label(name: str, shape: dict) -> str:
    return (
        f"{name} ({shape['num_layers']} layers, h {shape['hidden_size']}, "
        f"s {shape['seq_length']}, b {shape['micro_batch_size']})"
    )


def _choices(grid: dict, field: str) -> tuple[list, object]:
    """The values a control offers and its initial one: CP's from the "cp" table, whose models join the list."""
    if field == "cp":
        return grid["cp"]["values"], grid["cp"]["initial"]
    if field == "model":
        return [*grid["values"]["model"], *grid["cp"]["models"]], grid["initial"]["model"]
    return grid["values"][field], grid["initial"][field]


def _select(grid: dict, field: str, label: str, flag: str) -> str:
    values, initial = _choices(grid, field)
    shapes = {**grid["models"], **grid["cp"]["models"]}
    options = "".join(
        f'<option value="{escape(str(v))}"{" selected" if v == initial else ""}>'
        + escape(_model_label(v, shapes[v]) if field == "model" else str(v))
        + "</option>"
        for v in values
    )
    return (
        f'<label title="{escape(flag)}"><span>{escape(label)}</span>'
        f'<select name="{field}" data-flag="{escape(flag)}">{options}</select></label>'
    )


def _switch(grid: dict, field: str, label: str, flag: str) -> str:
    checked = " checked" if grid["initial"][field] else ""
    return (
        f'<label class="scale-calculator__switch" title="{escape(flag)}">'
        f'<input type="checkbox" name="{field}" data-flag="{escape(flag)}"{checked}> {escape(label)}</label>'
    )


def scale_calculator(grid: dict) -> str:
    """The calculator's HTML for a layout_grid trace (one per page: its fields go by name)."""
    fields = [f for f, _, _ in CONTROLS + SWITCHES if f != "cp"]
    missing = [f for f in fields if f not in grid["values"] or f not in grid["initial"]]
    missing += [] if isinstance(grid.get("cp"), dict) and {"values", "initial", "models"} <= set(grid["cp"]) else ["cp"]
    if missing:
        raise TraceError(f"trace {grid['name']}: no values for {', '.join(missing)}; {RECORD}")
    # JSON is a JavaScript expression; escaped, no "<" in it can end the script
    data = json.dumps(grid, separators=(",", ":")).replace("<", "\\u003c")
    return (
        '<div class="scale-calculator">'
        '<form class="scale-calculator__controls" aria-label="Layout">'
        + "".join(_select(grid, *control) for control in CONTROLS)
        + "".join(_switch(grid, *switch) for switch in SWITCHES)
        + "</form>"
        '<div class="scale-calculator__result" aria-live="polite">'
        "<p><em>The calculator needs JavaScript; the tables above are its numbers for the initial layout.</em></p>"
        "</div>"
        f"<script>document.currentScript.parentElement.scaleGrid = {data};</script>"
        "</div>\n"
    )

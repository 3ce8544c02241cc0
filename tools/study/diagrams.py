"""Diagrams generated from recorded runs (study.traces), never drawn by hand: mermaid, and SVG timelines.

`diagram(trace, ...)` draws a trace by its kind (GENERATORS): the tensor-parallel block as a flowchart
(`tp_block`) and one decoder layer of a DTensor plan with its placements (`dtensor`), an FSDP step or a
pipeline step as timelines on a time scale modeled from the recorded FLOPs and bytes (`fsdp_forward`,
`pipeline`, zero bubble's I and W in their own colours: study.modeled, study.timeline; `calibration=` a
device's measured rates, `measured=` its own recorded timeline beside the modeled one), a MoE
layer step as a token batch's journey
(study.moe_figure), each context-parallel rank's ring-attention blocks per ring step (`cp_blocks`,
study.cp_figure). `chart_training_memory` and `chart_sent_per_group` are mermaid charts of the formulas and of
a scale trace's checked rows. Every flowchart label goes through `label()`, so nothing recorded can break the
diagram's syntax.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

from study import scale_tables
from study.calibration import trace_rates
from study.cp_figure import cp_blocks
from study.modeled import (
    FSDP_COLORS,
    Rates,
    check_collectives_recorded,
    fsdp_measured,
    fsdp_modeled,
    pipeline_colors,
    pipeline_measured,
    pipeline_modeled,
    pipeline_note,
)
from study.moe_figure import moe_journey
from study.timeline import Bar, Panel, timeline
from study.traces import RECORD, TraceError, events_where

# aten ops that name what a group of ops does; layout ops (view, permute, ...) say nothing and are left out.
OP_NAMES = {
    "_scaled_dot_product_flash_attention_for_cpu": "scaled dot-product attention",
    "_scaled_dot_product_flash_attention": "scaled dot-product attention",
    "_scaled_dot_product_efficient_attention": "scaled dot-product attention",
    "scaled_dot_product_attention": "scaled dot-product attention",
    "gelu": "GELU",
    "silu": "SiLU",
    "add": "add",
    "mul": "mul",
    "softmax": "softmax",
    "_softmax": "softmax",
    "dropout": "dropout",
    "native_dropout": "dropout",
}
# aten op runs that together do one named thing: read before OP_NAMES, so their ops are not named one by one.
OP_RUNS = {
    ("split", "mul", "neg", "cat", "mul", "add"): "rotary",  # x cos + rotate_half(x) sin (reference...rotary)
    ("split", "silu", "mul"): "SwiGLU",  # silu(gate) * up on the fused [gate; up] output
}
MERMAID_ESCAPES = {
    "#": "#35;",
    '"': "#quot;",
    "<": "#lt;",
    ">": "#gt;",
    "`": "#96;",
    "|": "#124;",
    ";": "#59;",
    "\n": " ",
    "\r": " ",
}
OP_LABEL = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}


def label(text: str) -> str:
    """`text` as a quoted mermaid label: entity codes for every character the grammar gives a meaning."""
    return '"' + "".join(MERMAID_ESCAPES.get(ch, ch) for ch in str(text)) + '"'


def gantt_text(text: str) -> str:
    """Gantt task names have no quoting: keep them to characters the gantt grammar treats as text."""
    return "".join(ch if ch.isalnum() or ch in " ._-()+/," else " " for ch in str(text)).strip()


def human_bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.3g} KiB" if n < 1024**2 else f"{n / 1024**2:.3g} MiB"


def mermaid_fence(body: list[str]) -> str:
    return "```mermaid\n" + "\n".join(body) + "\n```\n"


def _op_names(ops: list[str]) -> list[str]:
    """What `ops` do, in order: each run in OP_RUNS by its name, then each op OP_NAMES names."""
    names, i = [], 0
    while i < len(ops):
        run = next((run for run in OP_RUNS if tuple(ops[i : i + len(run)]) == run), None)
        if run is not None:
            names.append(OP_RUNS[run])
            i += len(run)
        else:
            names += [OP_NAMES[ops[i]]] if ops[i] in OP_NAMES else []
            i += 1
    return names


def _ops_label(ops: list[str]) -> str | None:
    counts = Counter(_op_names(ops))
    return ", ".join(f"{name} ×{n}" if n > 1 else name for name, n in counts.items()) or None


def _block_nodes(run: dict, block: str) -> list[tuple[str, str, str | None]]:
    """(parent module, label, module) for each leaf module and each named op group inside `block`."""
    nodes = []
    for step in run["forward_steps"]:
        if "module" in step and step["module"].startswith(block + "."):
            text = f"{step['module'].rsplit('.', 1)[-1]} · {step['type']}"
            if "ParallelLinear" in step["type"] and step.get("weight_shape"):
                text += " · weight {} × {} per rank".format(*step["weight_shape"])
            nodes.append((step["module"].rsplit(".", 1)[0], text, step["module"]))
        elif "in" in step and (step["in"] == block or step["in"].startswith(block + ".")):
            if (text := _ops_label(step["ops"])) is not None:
                nodes.append((step["in"], text, None))
    return nodes


def tp_block(trace: dict, link: str, block: str = "layers.0") -> str:
    """Flowchart of `block` in the first traced run: x -> modules and op groups in forward order -> y, forward
    collectives on thick edges labelled with bytes and `link`, backward ones dotted back to the input."""
    run = trace["runs"][0]
    nodes = _block_nodes(run, block)
    linears = {module for _, text, module in nodes if module and "ParallelLinear" in text}
    events = [e for e in run["events"] if e["module"].startswith(block + ".")]
    forward = [e for e in events if e["phase"] == "forward"]
    if not forward or any(e["module"] not in linears for e in events):
        raise TraceError(
            f"trace {trace['name']}: the recorder saw no tensor-parallel linear layer issuing the "
            f"collectives of {block}; cannot draw the TP block; {RECORD}"
        )
    shape = f"x [s, b, h] = [{trace['s']}, {trace['b']}, {run['h']}], on every rank"
    body = ["flowchart TB", f"  x([{label(shape)}]); y([{label('y, on every rank')}])"]
    for parent in dict.fromkeys(parent for parent, _, _ in nodes):
        defs = "; ".join(f"n{i}[{label(text)}]" for i, (p, text, _) in enumerate(nodes) if p == parent)
        if parent == block:
            body.append(f"  {defs}")
        else:
            name = parent.removeprefix(block + ".")
            body += [f"  subgraph {name.replace('.', '_')}[{label(name)}]", f"    {defs}", "  end"]
    chain = ["x", *(f"n{i}" for i in range(len(nodes))), "y"]  # node i is chain[i + 1]
    numbered = {id(e): n for n, e in enumerate(forward, start=1)}
    line = f"  {chain[0]}"
    for j in range(len(chain) - 1):  # one line per stretch between forward collectives
        issued = [e for e in forward if j > 0 and e["module"] == nodes[j - 1][2]]
        if issued:
            texts = [
                f"{OP_LABEL.get(e['op'], e['op'])} {numbered[id(e)]}, forward: {human_bytes(e['nbytes'])} over {link}"
                for e in issued
            ]
            body.append(line)
            line = f"  {chain[j]} ==>|{label('; '.join(texts))}| {chain[j + 1]}"
        else:
            line += f" --> {chain[j + 1]}"
    body.append(line)
    for i, (_, _, module) in enumerate(nodes):
        for e in events_where(events, module=module, phase="backward"):
            text = f"backward: {OP_LABEL.get(e['op'], e['op'])} of dX, {human_bytes(e['nbytes'])}"
            body.append(f"  {chain[i + 1]} -.->|{label(text)}| {chain[i]}")
    return mermaid_fence(body)


def _modeled_beside_measured(
    title: str,
    colors: dict[str, str],
    rates: Rates,
    modeled: list[Bar],
    measured: dict | None,
    measured_bars: Callable[[dict], list[Bar]],
    note: str = "",
    span: float | None = None,
) -> str:
    """The `modeled` bars of a recorded step on the modeled time scale (covering at least `span` seconds) and,
    given the `measured` trace, its own timeline (`measured_bars(measured)`) beside them, in the same colors
    and with the same `note`: the one panel pair of every timeline diagram."""
    return timeline(
        Panel(title, modeled, rates.axis, colors, note, span),
        measured
        and Panel(f"{title}, measured", measured_bars(measured), f"measured ({measured['name']})", colors, note),
    )


def fsdp_forward(
    trace: dict, link_GBps: float, tflops: float | None = None, calibration: dict | None = None, measured=None
) -> str:
    """The recorded FSDP step, forward and backward, on a modeled time scale (study.modeled) at the
    stated `tflops` or a `calibration`'s rates; with `measured`, that trace's own timeline beside it."""
    check_collectives_recorded(trace)
    rates = trace_rates(trace, link_GBps, tflops, calibration)
    title = f"FSDP step of one rank, world {trace['world']}, forward and backward"
    return _modeled_beside_measured(title, FSDP_COLORS, rates, fsdp_modeled(trace, rates), measured, fsdp_measured)


SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "zb-h1": "ZB-H1", "zbv": "ZB-V", "dualpipev": "DualPipeV"}
SAME_MODEL = ("pp", "m", "b", "s", "h", "layers")  # what two pipeline traces drawn on one scale must share


def pipeline(
    trace: dict,
    link_GBps: float,
    tflops: float | None = None,
    calibration: dict | None = None,
    measured=None,
    same_scale_as: dict | None = None,
) -> str:
    """The recorded pipeline step, a row per stage, each block numbered by its micro-batch, on a modeled time
    scale (as fsdp_forward); with `measured`, that trace's own timeline beside it. With `same_scale_as`, a
    step of the same model under another schedule, the axis covers both, so the longer step draws longer."""
    rates = trace_rates(trace, link_GBps, tflops, calibration)
    span = None
    if same_scale_as is not None:
        differ = [key for key in SAME_MODEL if trace.get(key) != same_scale_as.get(key)]
        if differ:
            raise TraceError(
                f"traces {trace['name']} and {same_scale_as['name']} ran different models ("
                + ", ".join(f"{key} {trace.get(key)} vs {same_scale_as.get(key)}" for key in differ)
                + f"), so one time scale would compare unequal work; {RECORD}"
            )
        span = max(bar.end for bar in pipeline_modeled(same_scale_as, rates))
    name = SCHEDULE_NAMES.get(trace["schedule"], trace["schedule"])
    if trace.get("v_shape"):
        name += f" ({trace['virtual_stages']} stages per rank, in a V)"
    elif trace.get("virtual_stages", 1) > 1:
        name = f"Interleaved 1F1B ({trace['virtual_stages']} chunks per stage)"
    title = f"{name}, {trace['pp']} stages, {trace['m']} micro-batches"
    if trace.get("layers"):
        title += f", {trace['layers']} layers"
    modeled = pipeline_modeled(trace, rates)
    colors, note = pipeline_colors(trace), pipeline_note(trace)
    return _modeled_beside_measured(title, colors, rates, modeled, measured, pipeline_measured, note, span)


CHART_COLORS = (("#c62828", "red"), ("#1565c0", "blue"), ("#ef8f00", "amber"))  # one per line, in order


def chart_training_memory(limit) -> str:
    """xychart-beta lines in three distinct colors, with a legend under the chart (mermaid draws none for
    line charts): DDP's bytes per rank, FSDP's over `world` ranks (the shards alone: the legend says so, since
    the units gathered at the moment come on top), and one GPU's memory."""
    sizes = ", ".join(f'"{b:g}B"' for b in limit.billions)
    palette = ", ".join(color for color, _ in CHART_COLORS)
    top = max(limit.ddp_GB)
    body = [
        '%%{init: {"themeVariables": {"xyChart": {"plotColorPalette": "' + palette + '"}}}}%%',
        "xychart-beta",
        f'  title "{gantt_text(f"Per-rank training memory, {limit.bytes_per_param} B per parameter")}"',
        f'  x-axis "parameters, billions (linear: equal steps)" [{sizes}]',
        f'  y-axis "GB per rank" 0 --> {top:g}',
        f"  line [{', '.join(f'{v:g}' for v in limit.ddp_GB)}]",
        f"  line [{', '.join(f'{v:g}' for v in limit.fsdp_GB)}]",
        f"  line [{', '.join(f'{limit.gpu_GB:g}' for _ in limit.billions)}]",
    ]
    names = [
        f"DDP (every rank holds all {limit.bytes_per_param} B per parameter)",
        f"FSDP over {limit.world} ranks ({limit.bytes_per_param}/{limit.world} B per parameter, plus about two units'"
        " gathered parameters and gradients, not drawn)",
        f"one {limit.gpu_GB:g} GB GPU (activations aside)",
    ]
    legend = " · ".join(
        f'<span style="color:{color}">■</span> {word}: {name}' for (color, word), name in zip(CHART_COLORS, names)
    )
    return mermaid_fence(body) + f'\n<p class="chart-legend">{legend}</p>\n'


def chart_sent_per_group(trace: dict) -> str:
    """A horizontal xychart of the GiB one rank sends per step to each process group, per pipeline stage: the
    rows of scale_tables.scale_table (checked the same way) drawn, each bar's value in its label (mermaid's own
    data labels shrink with the bars, below a readable size)."""
    runs, by = [run for run, _ in scale_tables.checked_runs(trace)], "rank" if "groups" in trace else "stage"
    bars = [
        (
            f"{name}, {'' if 'label' in run else 'stage '}{scale_tables.run_name(trace, run)}",
            scale_tables.sent_per_group(trace, run)[group] / 2**30,
        )
        for group, name in scale_tables.groups_of(trace).items()
        for run in runs
    ]
    config = {"xyChart": {"width": 760, "height": 440}, "themeVariables": {"xyChart": {"plotColorPalette": "#1565c0"}}}
    title = f"GiB one rank sends per step, by process group and {by} ({trace['name']})"
    axis = "rings, all-to-all rows out" if "groups" in trace else "ring algorithms"
    body = [
        "%%{init: " + json.dumps(config) + "}%%",
        "xychart-beta horizontal",
        f'  title "{gantt_text(title)}"',
        "  x-axis [" + ", ".join(f'"{gantt_text(name)}: {value:.2f}"' for name, value in bars) + "]",
        f'  y-axis "GiB sent per step ({axis})" 0 --> {max(v for _, v in bars) * 1.1:.0f}',
        "  bar [" + ", ".join(f"{value:.2f}" for _, value in bars) + "]",
    ]
    return mermaid_fence(body)


def dtensor_layer(trace: dict, link: str, layer: int = 0) -> str:
    """Flowchart of one decoder layer of a DTensor plan's run (`torchrun -m reference.hf_tp --json`): each linear
    with its style and the weight rank 0 holds (local of whole shape, placement), the norms the plan leaves
    whole, the forward all-reduces of the two RowwiseParallel outputs (Partial to Replicate) on thick edges and
    the backward all-reduces of each ColwiseParallel input's gradient dotted back, with the bytes recorded."""
    prefix = f"model.layers.{layer}."
    styles = {entry["module"].replace("*", str(layer)): entry["style"].split("(")[0] for entry in trace["plan"]}
    weights = {w["name"].removesuffix(".weight"): w for w in trace["parameters"] if w["name"].endswith(".weight")}
    counted = {
        (c["phase"], c["kind"]): c for c in trace["collectives"] if c["where"] == prefix.rstrip(".")
    }  # what CommDebugMode counted in the layer
    colwise = [m for m, style in styles.items() if m.startswith(prefix) and style == "ColwiseParallel"]
    rowwise = [m for m, style in styles.items() if m.startswith(prefix) and style == "RowwiseParallel"]
    forward, backward = counted.get(("forward", "all_reduce")), counted.get(("backward", "all_reduce"))
    if not forward or not backward or (forward["count"], backward["count"]) != (len(rowwise), len(colwise)):
        raise TraceError(
            f"trace {trace['name']}: layer {layer} should all-reduce once per RowwiseParallel output forward "
            f"({len(rowwise)}) and once per ColwiseParallel input gradient backward ({len(colwise)}); {RECORD}"
        )

    def text(module: str) -> str:
        w, name = weights[prefix + module], module.rsplit(".", 1)[-1]
        if prefix + module not in styles:
            return f"{name} · not in the plan · weight {' × '.join(map(str, w['shape']))}, whole on every rank"
        held = " × ".join(map(str, w["local_shape"])) + " of " + " × ".join(map(str, w["shape"]))
        return f"{name} · {styles[prefix + module]} · weight {held}, {w['placement']}"

    c = trace["config"]
    x = f"x [b, s, h] = [{c['b']}, {trace['padded_s']}, {c['h']}], a plain tensor, whole on every rank"
    per_rank = [c[heads] * c["head_dim"] // trace["world"] for heads in ("heads", "kv_heads")]
    local = "q local [{0}, {1}, {2}], k and v [{0}, {1}, {3}]".format(c["b"], trace["padded_s"], *per_rank)
    reduce = f"all-reduce, forward: {human_bytes(forward['each'])} over {link}"
    back = f"backward: all-reduce of dX, {human_bytes(backward['each'])}"
    body = [
        "flowchart TB",
        f"  x([{label(x)}]); y([{label('y, plain, whole on every rank')}])",
        f"  n1[{label(text('input_layernorm'))}]; n2[{label(text('post_attention_layernorm'))}]",
        "  subgraph self_attn",
        *(f"    {m}[{label(text('self_attn.' + m))}]" for m in ("q_proj", "k_proj", "v_proj", "o_proj")),
        f"    attn[{label(f'attention on this rank’s heads: {local}')}]",
        "  end",
        "  subgraph mlp",
        *(f"    {m}[{label(text('mlp.' + m))}]" for m in ("gate_proj", "up_proj", "down_proj")),
        f"    act[{label('SiLU(gate) ⊙ up, elementwise')}]",
        "  end",
        f"  r1([{label('+ residual')}]); r2([{label('+ residual')}])",
        "  x --> n1 --> q_proj & k_proj & v_proj --> attn --> o_proj",
        f"  o_proj ==>|{label(reduce)}| r1 --> n2 --> gate_proj & up_proj --> act --> down_proj",
        f"  down_proj ==>|{label(reduce)}| r2 --> y",
        *(f"  {m} -.->|{label(back)}| n1" for m in ("q_proj", "k_proj", "v_proj")),
        *(f"  {m} -.->|{label(back)}| n2" for m in ("gate_proj", "up_proj")),
    ]
    return mermaid_fence(body)


GENERATORS = {
    "tp_block": tp_block,
    "fsdp_forward": fsdp_forward,
    "pipeline": pipeline,
    "moe": moe_journey,
    "cp_blocks": cp_blocks,
    "dtensor": dtensor_layer,
}


def diagram(trace: dict, **options) -> str:
    return GENERATORS[trace["kind"]](trace, **options)

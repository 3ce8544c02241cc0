"""The blocks each context-parallel rank computes at each ring step, as inline SVG: `diagram("cp_blocks")`.

One panel per recorded run (`torchrun --nproc-per-node 4 -m reference.measure.cp_blocks --json`, recorded by
tools/record-traces): without load balancing, then head-tail balanced. A row per cp rank, a column per ring step;
each cell holds the (query chunk, key chunk) blocks of the chunks the rank holds against the K/V it holds at that
step, drawn full, masked (the causal diagonal: a triangle) or skipped (an outline), every chunk number read from
the trace. The last column is the query-key pairs the rank attended in all; the bottom row is each step's
largest, the time the ring step takes when every rank waits for the slowest before passing K/V on. Drawn as
timeline.py draws (its sizes and text).
"""

from __future__ import annotations

import html

from study.timeline import FONT_PX, SMALL_PX, WIDTH, _text
from study.traces import RECORD, TraceError

KIND_COLORS = {"full": "#1565c0", "masked": "#1565c0", "skipped": "#9e9e9e"}
LEFT = 150  # the rank names' column
PAIRS = 120  # the pairs column
CELL_H = 56
ROW_GAP = 6
BLOCK_GAP = 4


def _checked(trace: dict) -> list[dict]:
    """The trace's runs, each with cp ranks of cp steps of known block kinds; TraceError otherwise."""
    cp, runs = trace["cp"], trace["runs"]
    for run in runs:
        if len(run["ranks"]) != cp or any(len(r["steps"]) != cp for r in run["ranks"]):
            raise TraceError(f"trace {trace['name']}: a run lacks a rank or a ring step of cp {cp}; {RECORD}")
        kinds = {b["kind"] for r in run["ranks"] for st in r["steps"] for b in st["blocks"]}
        if not kinds <= set(KIND_COLORS):
            raise TraceError(f"trace {trace['name']}: unknown block kinds {sorted(kinds - set(KIND_COLORS))}; {RECORD}")
    return runs


def _block(x: float, y: float, w: float, h: float, block: dict) -> list[str]:
    kind, name = block["kind"], f"q{block['query_chunk']} k{block['key_chunk']}"
    tip = f"query chunk {block['query_chunk']}, key chunk {block['key_chunk']}: {kind}, {block['pairs']} pairs"
    title = f"<title>{html.escape(tip)}</title>"
    color = KIND_COLORS[kind]
    if kind == "full":
        shape = f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{color}">{title}</rect>'
        text_fill = "#fff"
    elif kind == "masked":  # keys at or before each query: the lower-left triangle of the block
        shape = (
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="none" stroke="{color}">'
            f'{title}</rect><polygon points="{x:.1f},{y:.1f} {x:.1f},{y + h:.1f} {x + w:.1f},{y + h:.1f}" '
            f'fill="{color}" fill-opacity="0.45"/>'
        )
        text_fill = "currentColor"
    else:
        shape = (
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="none" stroke="{color}" '
            f'stroke-dasharray="3 2">{title}</rect>'
        )
        text_fill = color
    return [shape, _text(x + w / 2, y + h / 2 + SMALL_PX / 3, name, "middle", fill=text_fill, size=SMALL_PX)]


def _panel(run: dict, cp: int, top: float) -> tuple[list[str], float]:
    """One run's grid from `top`; its SVG elements and the height it took."""
    n = run["chunks"]
    held = len(run["ranks"][0]["chunks"])
    how = (
        f"head-tail balanced: {n} chunks of {run['chunk_length']} tokens, rank r holds chunks r and {n - 1} − r"
        if run["balanced"]
        else f"not balanced: {n} chunks of {run['chunk_length']} tokens, rank r holds chunk r"
    )
    out = [_text(8, top + FONT_PX, how, weight="bold")]
    col = (WIDTH - LEFT - PAIRS - 8) / cp
    y = top + FONT_PX + 10
    for step in range(cp):
        out.append(_text(LEFT + (step + 0.5) * col, y + FONT_PX, f"step {step}", "middle"))
    out.append(_text(WIDTH - PAIRS / 2 - 8, y + FONT_PX, "pairs", "middle"))
    y += FONT_PX + 8
    bh = (CELL_H - BLOCK_GAP * (held - 1)) / held
    for r in run["ranks"]:
        out.append(_text(8, y + CELL_H / 2, f"rank {r['rank']}", weight="bold"))
        out.append(_text(8, y + CELL_H / 2 + FONT_PX + 2, f"chunks {', '.join(map(str, r['chunks']))}", size=SMALL_PX))
        for st in r["steps"]:
            x0 = LEFT + st["step"] * col + 6
            bw = (col - 12 - BLOCK_GAP * (len(st["key_chunks"]) - 1)) / len(st["key_chunks"])
            for b in st["blocks"]:
                qi, ki = r["chunks"].index(b["query_chunk"]), st["key_chunks"].index(b["key_chunk"])
                out += _block(x0 + ki * (bw + BLOCK_GAP), y + qi * (bh + BLOCK_GAP), bw, bh, b)
        out.append(_text(WIDTH - PAIRS / 2 - 8, y + CELL_H / 2 + FONT_PX / 3, str(r["pairs"]), "middle", "bold"))
        y += CELL_H + ROW_GAP
    slowest = [max(r["steps"][step]["pairs"] for r in run["ranks"]) for step in range(cp)]
    out.append(_text(8, y + FONT_PX, "slowest rank", weight="bold"))  # the step's time: all wait for it
    for step, pairs in enumerate(slowest):
        out.append(_text(LEFT + (step + 0.5) * col, y + FONT_PX, str(pairs), "middle"))
    out.append(_text(WIDTH - PAIRS / 2 - 8, y + FONT_PX, f"ring {sum(slowest)}", "middle", "bold"))
    y += FONT_PX + 12
    return out, y - top


def cp_blocks(trace: dict) -> str:
    """The SVG of a recorded cp_blocks trace: a grid per run, ranks by ring steps."""
    runs, cp = _checked(trace), trace["cp"]
    title = f"Ring attention, cp {cp}, {trace['seq_length']} causal tokens: the blocks per rank and ring step"
    out, y = [_text(WIDTH / 2, FONT_PX + 2, title, "middle", "bold")], FONT_PX + 14
    for run in runs:
        drawn, h = _panel(run, cp, y)
        out += drawn
        y += h + 8
    legend = [("full", "full: keys all before the queries"), ("masked", "masked: the causal diagonal")]
    legend.append(("skipped", "skipped: keys all after"))
    x = 8.0
    for kind, name in legend:
        sample = {"kind": kind, "query_chunk": "", "key_chunk": "", "pairs": 0}
        out.append(_block(x, y, 3 * FONT_PX, FONT_PX + 4, sample)[0])  # the shape alone, no chunk names
        out.append(_text(x + 3 * FONT_PX + 6, y + FONT_PX, name, size=SMALL_PX + 1))
        x += 3 * FONT_PX + 6 + len(name) * 6.6 + 18
    y += FONT_PX + 12
    note = (
        f"pairs: query-key pairs attended (key position ≤ query position), {trace['pairs_total']} in all. A step "
        "lasts as long as its slowest rank; ring: the sum of the slowest."
    )
    out.append(_text(8, y + FONT_PX, note, size=SMALL_PX + 1))
    height = y + FONT_PX + 8
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" role="img" '
        f'class="timeline-svg cp-blocks" aria-label="{html.escape(title)}">'
    )
    return '<div class="timeline">\n' + "\n".join([head, *out, "</svg>"]) + "\n</div>\n"

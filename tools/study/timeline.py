"""Timelines as inline SVG at body-text size: rows of bars on a time axis with its unit, and a legend.

`timeline(modeled, measured=None)` draws one Panel, or two side by side: a modeled run (study.modeled,
whose axis says at what FLOP rate and link bandwidth) and, when a device recorded one, the measured timeline of
the same step. Drawn here rather than as a mermaid gantt: a gantt's axis is calendar time (minutes at best),
and mermaid scales its text with the chart's width, below a readable size.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

FONT_PX = 14  # body text (the browser test requires at least 11 px)
SMALL_PX = 11  # a label inside a bar too narrow for body text (a micro-batch number in an interleaved chunk)
WIDTH, ROW, BAR = 800, 30, 20  # the SVG is drawn at its size, never scaled (content is 832 px wide at 1280)
CHAR_PX = 7.6  # an estimate of a character's width, to decide whether a label fits its bar
UNITS = ((1e-6, "ns", 1e9), (1e-3, "µs", 1e6), (1.0, "ms", 1e3), (math.inf, "s", 1.0))


@dataclass(frozen=True)
class Bar:
    row: str  # the row it is drawn on, rows in order of first appearance
    kind: str  # its legend entry, which gives its colour
    label: str  # its name in the tooltip, and inside the bar when it fits and `short` is empty
    start: float  # seconds
    end: float
    detail: str = ""  # more for the tooltip (bytes, FLOPs)
    short: str = ""  # written inside the bar instead of `label`, where the row already says the rest


@dataclass(frozen=True)
class Panel:
    title: str
    bars: list[Bar]
    axis: str  # what the time axis is: "modeled at 100 TFLOP/s, 50 GB/s", "measured on ..."
    colors: dict[str, str]  # kind -> colour, in legend order
    note: str = ""  # lines under the legend ("\n" between them): how to read the labels
    span: float | None = None  # seconds the axis covers at least: panels compared on one scale


def _unit(seconds: float) -> tuple[str, float]:
    return next((name, scale) for limit, name, scale in UNITS if seconds < limit)


def _step(span: float) -> float:
    """A 1-2-5 tick step giving 5 to 10 ticks over `span`."""
    raw = span / 8
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def _text(
    x: float,
    y: float,
    text: str,
    anchor: str = "start",
    weight: str = "normal",
    fill: str = "currentColor",
    size: int = FONT_PX,
) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
        f'fill="{fill}">{html.escape(text)}</text>'
    )


def _fitting_size(text: str, width: float) -> int | None:
    """FONT_PX if `text` fits a bar `width` px wide with room around it, else SMALL_PX if it fits at all."""
    sizes = ((FONT_PX, 6), (SMALL_PX, 2))  # (px, margin): a narrow bar's digit may nearly touch its edges
    return next((px for px, margin in sizes if len(text) * CHAR_PX * px / FONT_PX + margin <= width), None)


def panel_svg(panel: Panel) -> str:
    rows = list(dict.fromkeys(bar.row for bar in panel.bars))
    end = max(max(bar.end for bar in panel.bars), panel.span or 0) or 1e-9
    unit, scale = _unit(end)
    step = _step(end * scale)
    ticks = [i * step for i in range(int(end * scale / step) + 2)]
    left = max(len(row) for row in rows) * CHAR_PX + 16
    plot = WIDTH - left - 16
    top = 2 * ROW
    x = lambda seconds: left + seconds * scale / ticks[-1] * plot
    legend_y = top + len(rows) * ROW + 2.4 * ROW
    legend_rows = (len(panel.colors) + 2) // 3
    notes = panel.note.split("\n") if panel.note else []
    height = legend_y + ROW * (legend_rows + len(notes)) - ROW / 2
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" role="img" '
        f'class="timeline-svg" aria-label="{html.escape(panel.title)}">',
        _text(WIDTH / 2, ROW * 0.8, panel.title, "middle", "bold"),
    ]
    for i, row in enumerate(rows):
        y = top + i * ROW
        out.append(_text(left - 8, y + ROW / 2 + FONT_PX / 3, row, "end"))
        out.append(f'<line x1="{left}" x2="{left + plot}" y1="{y + ROW:.1f}" y2="{y + ROW:.1f}" stroke="#8884"/>')
    for tick in ticks:
        tx = left + tick / ticks[-1] * plot
        out.append(f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{top}" y2="{top + len(rows) * ROW}" stroke="#8882"/>')
        out.append(_text(tx, top + len(rows) * ROW + FONT_PX + 4, f"{tick:g}", "middle"))
    out.append(_text(left + plot / 2, top + len(rows) * ROW + 2 * FONT_PX + 10, f"{unit}, {panel.axis}", "middle"))
    for bar in panel.bars:
        y, x0, x1 = top + rows.index(bar.row) * ROW + (ROW - BAR) / 2, x(bar.start), x(bar.end)
        tip = f"{bar.label}: {bar.start * scale:.3g}–{bar.end * scale:.3g} {unit}"
        tip += f", {bar.detail}" if bar.detail else ""
        out.append(
            f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0, 1.5):.1f}" height="{BAR}" '
            f'fill="{panel.colors[bar.kind]}" stroke="#fff" stroke-width="1">'
            f"<title>{html.escape(tip)}</title></rect>"
        )
        inside = bar.short or bar.label
        if size := _fitting_size(inside, x1 - x0):
            out.append(_text((x0 + x1) / 2, y + BAR / 2 + size / 3, inside, "middle", fill="#fff", size=size))
    for i, (kind, color) in enumerate(panel.colors.items()):
        lx, ly = 8 + (i % 3) * (WIDTH / 3), legend_y + (i // 3) * ROW
        out.append(
            f'<rect x="{lx:.1f}" y="{ly - FONT_PX + 2:.1f}" width="{FONT_PX}" height="{FONT_PX}" fill="{color}"/>'
        )
        out.append(_text(lx + FONT_PX + 6, ly, kind))
    for i, note in enumerate(notes):
        out.append(_text(8, legend_y + (legend_rows + i) * ROW, note))
    return "\n".join(out + ["</svg>"])


def timeline(modeled: Panel, measured: Panel | None = None) -> str:
    """The HTML of one timeline, or of a modeled and a measured one side by side (wrapping when narrow)."""
    panels = [modeled] + ([measured] if measured else [])
    return '<div class="timeline">\n' + "\n".join(panel_svg(p) for p in panels) + "\n</div>\n"

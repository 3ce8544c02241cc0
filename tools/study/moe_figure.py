"""One token batch's journey through a recorded MoE layer step, as inline SVG: `diagram("moe_ep2")`.

A column per rank of one expert-parallel group, six bands from top to bottom, every number the trace's
(`torchrun -m reference --moe --json`, tools/record-traces): each rank routes its tokens (pairs per expert, each
expert's cell under the rank that holds it), permutes the pairs into rows grouped by destination rank, the
all-to-all sends each group to its rank (arrows labelled with rows and bytes; each rank's recorded all-to-all
under them), the experts compute the rows they received sorted by expert, the rows go back the same way, and each
rank sums its tokens' rows. Bars are drawn to one scale in rows and coloured by the rank whose tokens they are,
so the uneven loads show. Drawn as timeline.py draws (its sizes and text), not as mermaid: mermaid cannot draw
bars to scale.
"""

from __future__ import annotations

import html

from study.timeline import CHAR_PX, FONT_PX, SMALL_PX, WIDTH, _fitting_size, _text
from study.traces import RECORD, TraceError

RANK_COLORS = ("#1565c0", "#ef6c00", "#2e7d32", "#6a1b9a", "#00838f", "#ad1457", "#4e342e", "#c62828")
LEFT = 150  # the band names' column
BAR = 22  # a bar's height
ROW_KEYS = ("rank", "ep_group", "tp_group", "tokens", "pairs_per_expert", "input_splits", "output_splits")
ROW_KEYS += ("rows_per_local_expert", "collectives")
BANDS = (  # (name, second line, height)
    ("1. route", "top-k per token", 88),
    ("2. permute", "rows by destination", 46),
    ("3. all-to-all", "dispatch", 108),
    ("4. experts", "rows sorted by expert", 76),
    ("5. all-to-all", "back to the senders", 108),
    ("6. unpermute,", "combine", 62),
)


def _halo(x: float, y: float, text: str, anchor: str = "start", size: int = SMALL_PX) -> str:
    """Text over the arrows, outlined in the page's background colour (notes.css: .moe-journey .halo)."""
    return _text(x, y, text, anchor, size=size).replace("<text ", '<text class="halo" ', 1)


def _color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def _bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.3g} KiB"


def _segments(x: float, y: float, parts: list[tuple[int, str, str, str]], scale: float) -> list[str]:
    """A bar of `parts` (rows, colour, label inside, tooltip) from (x, y), `scale` px per row."""
    out = []
    for rows, color, inside, tip in parts:
        w = rows * scale
        if rows:
            out.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{BAR}" fill="{color}" stroke="#fff" '
                f'stroke-width="1"><title>{html.escape(tip)}</title></rect>'
            )
            if inside and (size := _fitting_size(inside, w)):
                out.append(_text(x + w / 2, y + BAR / 2 + size / 3, inside, "middle", fill="#fff", size=size))
        x += w
    return out


def _arrow(x0: float, y0: float, x1: float, y1: float, color: str) -> str:
    return (
        f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" y2="{y1:.1f}" stroke="{color}" stroke-width="2" '
        f'marker-end="url(#moe-arrow)"/>'
    )


def _checked(trace: dict, step: int) -> tuple[dict, list[dict]]:
    """The step and the rows of rank 0's EP group, checked against each other and the recorded bytes."""
    config = trace["config"]
    steps = [s for s in trace["steps"] if s.get("step") == step]
    if not steps:
        raise TraceError(f"trace {trace['name']} has no step {step}; {RECORD}")
    ranks = {r.get("rank"): r for r in steps[0].get("ranks", [])}
    if config.get("tp", 1) != 1 or any(set(ROW_KEYS) - set(r) for r in ranks.values()) or 0 not in ranks:
        raise TraceError(
            f"trace {trace['name']}: the journey figure draws expert parallelism alone (tp 1), from each rank's "
            f"{', '.join(ROW_KEYS)}; {RECORD}"
        )
    rows = [ranks[r] for r in ranks[0]["ep_group"]]
    row_bytes = config["hidden_size"] * config["dtype_size"]
    for r in rows:
        moved = [c["nbytes"] for c in r["collectives"] if c["op"] == "all_to_all" and c["dtype"] != "int64"]
        expected = [n * row_bytes for n in (sum(r["input_splits"]), sum(r["output_splits"]))]
        if moved[:2] != expected or sum(r["pairs_per_expert"]) != expected[0] // row_bytes:
            raise TraceError(
                f"trace {trace['name']}: rank {r['rank']}'s recorded all-to-alls ({moved}) are not its split sizes "
                f"times {row_bytes} B a row; {RECORD}"
            )
    return steps[0], rows


def moe_journey(trace: dict, step: int = 1) -> str:
    """The SVG of step `step` of a recorded MoE run (trace kind "moe"), one column per rank of rank 0's EP group."""
    step_report, rows = _checked(trace, step)
    config = trace["config"]
    ep, local, k = len(rows), config["experts_per_rank"], config["topk"]
    row_bytes, experts = config["hidden_size"] * config["dtype_size"], config["num_experts"]
    group = [r["rank"] for r in rows]
    col = (WIDTH - LEFT - 8) / ep
    pad = 14
    widest = max(max(sum(r["input_splits"]), sum(r["output_splits"])) for r in rows)
    scale = (col - 2 * pad) / widest  # px per row, one scale for every bar
    top = 2.2 * FONT_PX + 22
    height = top + sum(h for _, _, h in BANDS) + 3.4 * FONT_PX
    title = (
        f"One step of the MoE layer at EP {ep} ({trace['name']}, step {step}): {experts} experts, top-{k}, "
        f"h {config['hidden_size']}"
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" role="img" '
        f'class="timeline-svg moe-journey" aria-label="{html.escape(title)}">',
        '<defs><marker id="moe-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#888"/></marker></defs>',
        _text(WIDTH / 2, FONT_PX + 2, title, "middle", "bold"),
    ]
    x0 = [LEFT + i * col + pad for i in range(ep)]  # each column's bar start
    for i, r in enumerate(rows):
        out.append(_text(LEFT + (i + 0.5) * col, 2 * FONT_PX + 14, f"rank {r['rank']}", "middle", "bold"))
    y, names = top, []
    for name, second, h in BANDS:
        names.append(y)
        out.append(_text(8, y + FONT_PX, name, weight="bold"))
        out.append(_text(8, y + 2 * FONT_PX + 4, second, size=SMALL_PX + 1))
        y += h
        out.append(f'<line x1="8" x2="{WIDTH - 8}" y1="{y - 6:.1f}" y2="{y - 6:.1f}" stroke="#8883"/>')
    route, permute, dispatch, compute, back, combine = names

    def exchange(y_from: float, y_to: float, splits_from: str, splits_to: str, label_y: float) -> None:
        """Arrows from each rank's bar segment j to rank j's segment i; labels near their tails."""
        for i, r in enumerate(rows):
            start = x0[i]
            for j, n in enumerate(r[splits_from]):
                if n:
                    end = x0[j] + sum(rows[j][splits_to][:i]) * scale + n * scale / 2
                    tail = start + n * scale / 2
                    out.append(_arrow(tail, y_from, end, y_to - 2, _color(r["rank"])))
                    at = tail + (end - tail) * (label_y - y_from) / (y_to - y_from)
                    if i == j:  # left of its arrow, a line lower than the crossing ones
                        out.append(_halo(at - 6, label_y + FONT_PX + 4, f"{n} rows stay", "end"))
                    else:  # on the side away from where the arrows cross
                        text, right = f"{n} rows, {_bytes(n * row_bytes)}", end < tail
                        out.append(_halo(at + (6 if right else -6), label_y, text, "start" if right else "end"))
                start += n * scale

    # 1. route: one cell per expert, this rank's pairs for it, outlined in the colour of the rank holding it
    cell = (col - 2 * pad) / experts
    for i, r in enumerate(rows):
        text = f"{r['tokens']} tokens × top-{k} = {sum(r['pairs_per_expert'])} pairs"
        out.append(_text(x0[i], route + FONT_PX, text))
        for e, n in enumerate(r["pairs_per_expert"]):
            cx, cy, owner = x0[i] + e * cell, route + FONT_PX + 10, group[e // local]
            out.append(
                f'<rect x="{cx:.1f}" y="{cy:.1f}" width="{cell - 2:.1f}" height="{BAR}" fill="none" '
                f'stroke="{_color(owner)}" stroke-width="2"><title>rank {r["rank"]}: {n} of its tokens chose expert '
                f"{e}, held by rank {owner}</title></rect>"
            )
            size = FONT_PX if len(str(n)) * CHAR_PX + 4 <= cell else SMALL_PX
            out.append(_text(cx + cell / 2 - 1, cy + BAR / 2 + size / 3, str(n), "middle", size=size))
            out.append(_text(cx + cell / 2 - 1, cy + BAR + SMALL_PX + 2, f"e{e}", "middle", size=SMALL_PX))

    # 2. permute: the pairs as rows, grouped by the rank holding their expert
    for i, r in enumerate(rows):
        parts = [
            (n, _color(r["rank"]), f"{n} → r{group[j]}", f"{n} rows for rank {group[j]}'s experts")
            for j, n in enumerate(r["input_splits"])
        ]
        out += _segments(x0[i], permute + 4, parts, scale)

    # 3. the dispatch all-to-all: the counts, then the rows; each rank's recorded bytes
    received_y = compute + FONT_PX + 4
    exchange(permute + 4 + BAR, received_y, "input_splits", "output_splits", dispatch + 16)
    for i, r in enumerate(rows):
        counts, rows_out = _a2a(r, "forward")[:2]
        text = f"counts {counts} B, then {sum(r['input_splits'])} rows × {row_bytes} B = {rows_out} B"
        out.append(_halo(x0[i], dispatch + 60, text))

    # 4. experts: the received rows sorted by local expert (within an expert, by sender)
    for i, r in enumerate(rows):
        parts, first = [], group.index(r["rank"]) * local
        for e in range(local):
            for s in rows:
                n = s["pairs_per_expert"][first + e]
                parts.append((n, _color(s["rank"]), "", f"expert {first + e}: {n} rows of rank {s['rank']}'s tokens"))
        out += _segments(x0[i], received_y, parts, scale)
        x = x0[i]
        for e, n in enumerate(r["rows_per_local_expert"]):
            label = f"e{first + e}: {n}"
            size = FONT_PX if len(label) * CHAR_PX + 4 <= n * scale else SMALL_PX
            out.append(_text(x + n * scale / 2, received_y + BAR + size + 4, label, "middle", size=size))
            out.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{received_y - 3:.1f}" y2="{received_y + BAR + 3:.1f}" '
                f'stroke="currentColor"/>'
            )
            x += n * scale
        text = f"received {sum(r['output_splits'])} rows {r['output_splits']}"
        out.append(_halo(x0[i] + col - 2 * pad, compute + FONT_PX - 6, text, "end"))

    # 5. back: the same rows, sorted back by sender, return; each rank gets back every row it sent
    back_y = back + 4
    for i, r in enumerate(rows):
        parts = [
            (n, _color(group[j]), f"{n} → r{group[j]}", f"{n} rows of rank {group[j]}'s tokens")
            for j, n in enumerate(r["output_splits"])
        ]
        out += _segments(x0[i], back_y, parts, scale)
    returned_y = combine + 4
    exchange(back_y + BAR, returned_y, "output_splits", "input_splits", back + 42)
    for i, r in enumerate(rows):
        text = f"{sum(r['output_splits'])} rows × {row_bytes} B = {_a2a(r, 'forward')[2]} B"
        out.append(_halo(x0[i], back + 80, text))

    # 6. unpermute and combine: each token's k rows, weighted by its probabilities, summed
    for i, r in enumerate(rows):
        parts = [
            (n, _color(r["rank"]), f"{n} from r{group[j]}", f"{n} rows back from rank {group[j]}")
            for j, n in enumerate(r["input_splits"])
        ]
        out += _segments(x0[i], returned_y, parts, scale)
        text = f"→ {r['tokens']} tokens, each the p-weighted sum of its {k} rows"
        out.append(_text(x0[i], returned_y + BAR + FONT_PX + 2, text, size=SMALL_PX))
    out += _legend(group, height)
    return '<div class="timeline">\n' + "\n".join(out + ["</svg>"]) + "\n</div>\n"


def _legend(group: list[int], height: float) -> list[str]:
    """Whose tokens each colour is, and how to read the cells and bars."""
    out, x, y = [], 8.0, height - 8 - FONT_PX * 1.4
    for g in group:
        name = f"rows of rank {g}'s tokens"
        out.append(
            f'<rect x="{x:.1f}" y="{y - FONT_PX + 2:.1f}" width="{FONT_PX}" height="{FONT_PX}" fill="{_color(g)}"/>'
        )
        out.append(_text(x + FONT_PX + 6, y, name))
        x += FONT_PX + 6 + len(name) * CHAR_PX + 24
    note = "Bars are drawn to one scale in rows; a route cell is outlined in the colour of the rank holding the expert."
    return out + [_text(8, height - 8, note, size=SMALL_PX + 1)]


def _a2a(row: dict, phase: str) -> list[int]:
    """The recorded bytes of this rank's all-to-alls in `phase`, in issue order."""
    return [c["nbytes"] for c in row["collectives"] if c["op"] == "all_to_all" and c["phase"] == phase]

"""The MoE walkthrough's figure (study.moe_figure), drawn from the committed trace moe_ep2: every
number it labels is the trace's (pairs per expert, split sizes, rows per expert, recorded all-to-all bytes), its
bars are drawn to one scale in rows, its text is at least the timelines' small size, and a trace it cannot draw
truthfully is a one-line error."""

from __future__ import annotations

import copy
import re

import pytest

from study import diagrams
from study.timeline import SMALL_PX
from study.traces import TraceError, load_trace
from tests.tools.conftest import ROOT

NOTES = ROOT / "reading_notes"


def texts(svg: str) -> list[str]:
    return [t.replace("&#x27;", "'") for t in re.findall(r"<text [^>]*>([^<]*)</text>", svg)]


def test_every_label_is_the_recorded_runs():
    trace = load_trace(NOTES, "moe_ep2")
    svg = diagrams.diagram(trace)
    shown, row_bytes = texts(svg), trace["config"]["hidden_size"] * trace["config"]["dtype_size"]
    step = trace["steps"][0]
    assert "One step of the MoE layer at EP 2 (moe_ep2, step 1): 8 experts, top-2, h 64" in shown
    for r in step["ranks"]:
        cells = [int(t) for t in shown if t.isdigit()]
        assert " ".join(map(str, r["pairs_per_expert"])) in " ".join(map(str, cells))
        assert [f"{n} → r{j}" for j, n in enumerate(r["input_splits"])] == [
            t for t in shown if t in {f"{n} → r{j}" for j, n in enumerate(r["input_splits"])}
        ][:2]
        counts, rows_out, rows_back = [c["nbytes"] for c in r["collectives"] if c["phase"] == "forward"]
        sent, received = sum(r["input_splits"]), sum(r["output_splits"])
        assert f"counts {counts} B, then {sent} rows × {row_bytes} B = {rows_out} B" in shown
        assert f"{received} rows × {row_bytes} B = {rows_back} B" in shown
        assert f"received {received} rows {r['output_splits']}" in shown
        first = r["rank"] * trace["config"]["experts_per_rank"]
        assert [f"e{first + e}: {n}" for e, n in enumerate(r["rows_per_local_expert"])] == [
            t for t in shown if t.startswith("e") and ": " in t and int(t[1:].split(":")[0]) // 4 == r["rank"]
        ]
    crossing = step["ranks"][0]["input_splits"][1]
    assert f"{crossing} rows, {crossing * row_bytes / 1024:.3g} KiB" in shown
    assert all(int(size) >= SMALL_PX for size in re.findall(r'<text [^>]*font-size="(\d+)"', svg))


def test_bars_are_drawn_to_one_scale_in_rows():
    svg = diagrams.diagram(load_trace(NOTES, "moe_ep2"))
    bar = r'<rect [^>]*width="([\d.]+)" height="22" fill="#[0-9a-f]{6}"[^>]*><title>(?:expert \d+: )?(\d+) rows'
    bars = re.findall(bar, svg)
    per_row = sorted(float(w) / int(n) for w, n in bars)  # px per row; widths are printed to 0.1 px
    # permute, experts (each expert's rows from each rank), back, returned: on each of the 2 ranks
    assert len(bars) == 4 + 2 * 4 * 2 + 4 + 4 and per_row[-1] / per_row[0] < 1.01, per_row


def test_a_trace_the_figure_cannot_draw_truthfully_is_a_one_line_error():
    trace = load_trace(NOTES, "moe_ep2")
    with pytest.raises(TraceError, match="has no step 2"):
        diagrams.diagram(trace, step=2)
    with pytest.raises(TraceError, match=r"expert parallelism alone \(tp 1\)"):
        diagrams.diagram(load_trace(NOTES, "moe_ep2_tp2"))
    tampered = copy.deepcopy(trace)
    tampered["steps"][0]["ranks"][1]["input_splits"] = [31, 35]
    with pytest.raises(TraceError, match="rank 1's recorded all-to-alls") as error:
        diagrams.diagram(tampered)
    assert "\n" not in str(error.value) and "re-record with tools/record-traces" in str(error.value)

"""Timelines on a modeled time scale: each span lasts its recorded FLOPs at the stated rate, each collective or
message its bytes at the stated bandwidth, in the recorded order; drawn as SVG at body-text size with a legend,
a measured timeline beside it when given one."""

from __future__ import annotations

import copy
import re

import pytest

from pin_and_cite.site import diagrams
from pin_and_cite.site.modeled import Rates, fsdp_modeled, pipeline_modeled
from pin_and_cite.site.scale_tables import sent_bytes
from pin_and_cite.site.timeline import FONT_PX
from pin_and_cite.site.traces import TraceError, load_trace
from tests.tools.conftest import ROOT

NOTES = ROOT / "reading_notes"
RATES = Rates(tflops=1, link_GBps=25)


def bars_of(bars, row):
    return [bar for bar in bars if bar.row == row]


def test_fsdp_spans_last_their_flops_and_collectives_their_ring_bytes_and_compute_waits_for_its_gather():
    trace = load_trace(NOTES, "fsdp_forward")
    bars = fsdp_modeled(trace, RATES)
    spans = {f"{s['name']}": s for s in trace["spans"]}
    compute = {bar.label: bar for bar in bars if bar.row != "collectives"}
    gathers = [bar for bar in bars if bar.kind == "all-gather"]
    assert sorted(compute) == sorted(spans) and len(gathers) == 5 and len(bars) == 6 + 8
    for name in ("layers.0 forward", "layers.1 forward"):  # leaf spans: exactly their FLOPs, no stall inside
        span, bar = spans[name], compute[name]
        assert bar.end - bar.start == pytest.approx((span["flops_end"] - span["flops_start"]) / 1e12)
    for bar, event in zip(bars_of(bars, "collectives"), trace["events"]):  # both in the order of issue
        assert bar.end - bar.start == pytest.approx(sent_bytes(event["op"], event["nbytes"], 2) / 25e9)
    one_stream = bars_of(bars, "collectives")
    assert all(a.end <= b.start + 1e-18 for a, b in zip(one_stream, one_stream[1:]))  # one at a time
    for unit in ("layers.0", "layers.1"):  # a unit computes only once its parameters are gathered
        gathered = next(b for b in gathers if b.label == f"AG {unit}")
        assert compute[f"{unit} forward"].start >= gathered.end
    # The forward all-gathers were issued before any FLOP (prefetch): the first starts at 0, back to back.
    assert [round(b.start * 1e9) for b in gathers[:3]] == [0, round(gathers[0].end * 1e9), round(gathers[1].end * 1e9)]


def test_pipeline_actions_last_their_flops_and_wait_for_the_message_from_the_neighbouring_stage():
    trace = load_trace(NOTES, "pipeline_1f1b")
    bars = pipeline_modeled(trace, RATES)
    message = 8 * 2 * 16 * 4 / 25e9  # one activation [s, b, h] in fp32 at 25 GB/s
    at = {(bar.row, bar.label): bar for bar in bars}
    for r, stage in enumerate(trace["stages"]):
        for action, flops in zip(stage["actions"], stage["action_flops"]):
            bar = at[f"stage {r}", action]
            assert bar.end - bar.start == pytest.approx(flops / 1e12) and flops > 0
            peer = r - 1 if action[0] == "F" else r + 1
            if 0 <= peer < trace["pp"]:
                assert bar.start >= at[f"stage {peer}", action].end + message - 1e-15
    assert at["stage 1", "F0"].start == pytest.approx(at["stage 0", "F0"].end + message)


def test_timeline_svg_states_its_rates_has_a_legend_and_body_size_text():
    svg = diagrams.diagram(load_trace(NOTES, "fsdp_forward"), tflops=1, link_GBps=25)
    assert svg.startswith('<div class="timeline">\n<svg ') and svg.count("<svg ") == 1
    assert "µs, modeled at 1 TFLOP/s, 25 GB/s</text>" in svg
    for legend in ("forward compute", "backward compute", "all-gather", "reduce-scatter"):
        assert f">{legend}</text>" in svg
    assert set(re.findall(r'font-size="(\d+)"', svg)) == {str(FONT_PX)} and FONT_PX >= 11
    gpipe = diagrams.diagram(load_trace(NOTES, "pipeline_gpipe"), tflops=1, link_GBps=25)
    assert "GPipe, 4 stages, 8 micro-batches</text>" in gpipe and ">stage 3</text>" in gpipe


def test_a_measured_trace_is_drawn_beside_the_modeled_one_at_its_own_times():
    trace = load_trace(NOTES, "pipeline_1f1b")
    measured = {**copy.deepcopy(trace), "name": "pipeline_1f1b_cuda"}
    html = diagrams.diagram(trace, tflops=1, link_GBps=25, measured=measured)
    assert html.count("<svg ") == 2 and "measured (pipeline_1f1b_cuda)</text>" in html
    assert "modeled at 1 TFLOP/s, 25 GB/s</text>" in html


def test_a_trace_without_flops_or_rates_that_are_not_positive_is_a_one_line_error():
    fsdp = copy.deepcopy(load_trace(NOTES, "fsdp_forward"))
    for span in fsdp["spans"]:
        del span["flops_end"]
    pipeline = copy.deepcopy(load_trace(NOTES, "pipeline_gpipe"))
    del pipeline["stages"][2]["action_flops"]
    for trace, message in ((fsdp, "carry no FLOP counts"), (pipeline, "actions carry no FLOP counts")):
        with pytest.raises(TraceError) as error:
            diagrams.diagram(trace, tflops=1, link_GBps=25)
        assert message in str(error.value) and "re-record with tools/record-traces" in str(error.value)
    with pytest.raises(TraceError, match="needs positive tflops and link_GBps, not 0 and 25"):
        diagrams.diagram(load_trace(NOTES, "pipeline_gpipe"), tflops=0, link_GBps=25)

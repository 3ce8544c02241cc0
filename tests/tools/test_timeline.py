"""Timelines on a modeled time scale: each span lasts its recorded FLOPs at the stated rate, each collective or
message its bytes at the stated bandwidth, in the recorded order; drawn as SVG at body-text size with a legend,
a measured timeline beside it when given one."""

from __future__ import annotations

import copy
import re

import pytest

from study import diagrams
from study.modeled import Rates, fsdp_modeled, pipeline_modeled
from study.scale_tables import sent_bytes
from study.timeline import FONT_PX, SMALL_PX
from study.traces import TraceError, load_trace
from tests.tools.conftest import ROOT

NOTES = ROOT / "reading_notes"
RATES = Rates(tflops=1, link_GBps=25)


def test_fsdp_spans_last_their_flops_and_collectives_their_ring_bytes_and_compute_waits_for_its_gather():
    trace = load_trace(NOTES, "fsdp_forward")
    bars = fsdp_modeled(trace, RATES)
    spans = {f"{s['name']}": s for s in trace["spans"]}
    moved = [bar for bar in bars if bar.kind in ("all-gather", "reduce-scatter")]
    compute = {bar.label: bar for bar in bars if bar not in moved}
    gathers = [bar for bar in bars if bar.kind == "all-gather"]
    assert sorted(compute) == sorted(spans) and len(gathers) == 5 and len(bars) == 6 + 8
    for name in ("layers.0 forward", "layers.1 forward"):  # leaf spans: exactly their FLOPs, no stall inside
        span, bar = spans[name], compute[name]
        assert bar.end - bar.start == pytest.approx((span["flops_end"] - span["flops_start"]) / 1e12)
    for bar, event in zip(moved, trace["events"]):  # both in the order of issue
        assert bar.end - bar.start == pytest.approx(sent_bytes(event["op"], event["nbytes"], 2) / 25e9)
    one_stream = moved
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
    assert set(re.findall(r'font-size="(\d+)"', svg)) <= {str(FONT_PX), str(SMALL_PX)} and SMALL_PX >= 11
    gpipe = diagrams.diagram(load_trace(NOTES, "pipeline_gpipe"), tflops=1, link_GBps=25)
    assert "GPipe, 4 stages, 8 micro-batches, 8 layers</text>" in gpipe and ">stage 3</text>" in gpipe


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


def test_the_interleaved_comparison_runs_the_same_model_as_1f1b_and_is_drawn_on_one_time_scale():
    """Finding: the interleaved note set a 4-layer 1F1B beside an 8-layer interleaved run, each on its own
    scale, so the run with the shorter bubble drew longer. Same layers and micro-batches, the same FLOPs in all:
    interleaved finishes first, and both panels share the axis of the longer one."""
    one, il = load_trace(NOTES, "pipeline_1f1b"), load_trace(NOTES, "pipeline_interleaved")
    assert (one["layers"], one["m"], one["pp"]) == (il["layers"], il["m"], il["pp"])
    flops = [sum(f for st in t["stages"] for f in st["action_flops"]) for t in (one, il)]
    assert flops[0] == flops[1]
    ends = [max(bar.end for bar in pipeline_modeled(t, RATES)) for t in (one, il)]
    assert ends[1] < ends[0]
    drawn = [diagrams.diagram(a, tflops=1, link_GBps=25, same_scale_as=b) for a, b in ((one, il), (il, one))]
    last_ticks = [
        re.findall(r'text-anchor="middle" font-weight="normal" fill="currentColor">([\d.]+)<', d) for d in drawn
    ]
    assert last_ticks[0] == last_ticks[1] and len(last_ticks[0]) > 3


def test_a_comparison_of_pipelines_of_different_models_is_a_one_line_error():
    one, il = load_trace(NOTES, "pipeline_1f1b"), copy.deepcopy(load_trace(NOTES, "pipeline_interleaved"))
    il["layers"] //= 2
    with pytest.raises(TraceError, match=r"pipeline_1f1b and pipeline_interleaved ran different models .*layers"):
        diagrams.diagram(one, tflops=1, link_GBps=25, same_scale_as=il)


def test_pipeline_blocks_are_numbered_by_micro_batch_and_chunks_have_their_own_colour_and_legend():
    """Finding: forward blocks and chunks were unlabeled and `F1.0` had no legend. In the demo's and the
    trace's names F<c>.<i> is chunk c, micro-batch i (reference.pipeline.steps)."""
    il = load_trace(NOTES, "pipeline_interleaved")
    svg = diagrams.diagram(il, tflops=1, link_GBps=25, same_scale_as=load_trace(NOTES, "pipeline_1f1b"))
    in_bars = re.findall(r'fill="#fff">(\d+)</text>', svg)
    assert len(in_bars) == sum(len(st["actions"]) for st in il["stages"])  # every block, forward and backward
    assert sorted(set(in_bars), key=int) == [str(i) for i in range(il["m"])]
    for legend in ("forward, chunk 0", "forward, chunk 1", "backward, chunk 0", "backward, chunk 1"):
        assert f">{legend}</text>" in svg
    assert "F1.0 = forward of chunk 1, micro-batch 0" in svg
    assert "<title>F1.0: " in svg  # the demo's name in the block's tooltip


def test_fsdp_collectives_are_drawn_on_the_row_of_the_unit_they_move():
    """Finding: collectives sat on one unlabeled row. Each is on its unit's row, labeled with its kind."""
    trace = load_trace(NOTES, "fsdp_forward")
    bars = fsdp_modeled(trace, RATES)
    moved = [bar for bar in bars if bar.kind in ("all-gather", "reduce-scatter")]
    events = [e for e in trace["events"] if e["op"] in ("all_gather", "reduce_scatter")]
    assert [(bar.row, bar.kind) for bar in moved] == [(e["module"], e["op"].replace("_", "-")) for e in events]
    assert {bar.row for bar in bars} == {u["name"] for u in trace["units"]}


def test_a_units_backward_compute_ends_where_the_next_unit_it_does_not_hold_begins():
    """Finding: layers.1's backward was drawn enclosing layers.0's. Its span runs to its post-backward hook,
    which in the recorded step fired after layers.0's compute; compute is one stream, so layers.1's own compute
    ended where layers.0's began. Only the root, which holds the layers (its forward encloses theirs), keeps
    theirs inside its bar."""
    bars = fsdp_modeled(load_trace(NOTES, "fsdp_forward"), RATES)
    backward = {bar.row: bar for bar in bars if bar.kind == "backward compute"}
    assert backward["layers.1"].end == pytest.approx(backward["layers.0"].start)
    assert backward["root"].start < backward["layers.1"].start and backward["root"].end >= backward["layers.0"].end
    for unit in ("layers.0", "layers.1"):  # a reduce-scatter is issued by its unit's hook, after its compute
        (scatter,) = [bar for bar in bars if bar.row == unit and bar.kind == "reduce-scatter"]
        assert scatter.start >= backward[unit].end

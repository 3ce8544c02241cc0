"""The CP walkthrough's figure (study.cp_figure), drawn from the committed trace cp_blocks: one block per
recorded (query chunk, key chunk) of every rank and ring step, drawn as its kind, each rank's pairs and each
step's slowest rank as the trace gives them, and a trace it cannot draw truthfully is a one-line error."""

from __future__ import annotations

import copy
import re

import pytest

from study import diagrams
from study.traces import TraceError, load_trace
from tests.tools.conftest import ROOT

NOTES = ROOT / "reading_notes"


def test_every_block_of_the_recorded_run_is_drawn_as_its_kind():
    trace = load_trace(NOTES, "cp_blocks")
    svg = diagrams.diagram(trace)
    tips = re.findall(r"<title>query chunk (\d+), key chunk (\d+): (\w+), (\d+) pairs</title>", svg)
    recorded = [
        (str(b["query_chunk"]), str(b["key_chunk"]), b["kind"], str(b["pairs"]))
        for run in trace["runs"]
        for r in run["ranks"]
        for st in r["steps"]
        for b in st["blocks"]
    ]
    assert tips == recorded
    shown = re.findall(r"<text [^>]*>([^<]*)</text>", svg)
    for run in trace["runs"]:
        for r in run["ranks"]:
            assert str(r["pairs"]) in shown
        slowest = [max(r["steps"][i]["pairs"] for r in run["ranks"]) for i in range(trace["cp"])]
        assert f"ring {sum(slowest)}" in shown
    unbalanced = [r["pairs"] for r in trace["runs"][0]["ranks"]]
    assert unbalanced == sorted(unbalanced) and len(set(unbalanced)) == trace["cp"]  # rank 0 idles most


def test_a_trace_missing_a_ring_step_is_one_line():
    trace = copy.deepcopy(load_trace(NOTES, "cp_blocks"))
    trace["runs"][1]["ranks"][2]["steps"].pop()
    with pytest.raises(TraceError, match=r"^trace cp_blocks: a run lacks a rank or a ring step of cp 4; re-record"):
        diagrams.diagram(trace)

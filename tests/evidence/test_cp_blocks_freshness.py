"""The committed CP walkthrough figure is what the reference ring attention does now.

tools/record-traces' recording of reference.measure.cp_blocks (four ranks under torchrun) run again: every rank's
blocks per ring step, full, masked or skipped, without and with head-tail balancing, must equal the committed
reading_notes/traces/cp_blocks.json, and the figure drawn from it must be the same SVG.
"""

from __future__ import annotations

import json

import pytest

from study import diagrams, record_traces
from study.traces import load_trace
from tests.launch import ROOT

pytestmark = pytest.mark.freshness

NOTES = ROOT / "reading_notes"


def test_the_committed_cp_blocks_trace_is_a_fresh_ring_attention_run(tmp_path):
    notes = tmp_path / "reading_notes"
    (written,) = record_traces.record_cp_blocks(notes / "traces", timeout=240)
    fresh, committed = json.loads(written.read_text()), json.loads((NOTES / "traces" / written.name).read_text())
    assert fresh == committed, "reading_notes/traces/cp_blocks.json is stale: re-record with tools/record-traces"
    assert diagrams.diagram(load_trace(notes, "cp_blocks")) == diagrams.diagram(load_trace(NOTES, "cp_blocks"))

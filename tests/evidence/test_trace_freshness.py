"""The committed traces are what the reference does now.

One torchrun launch of tools/trace_worker.py (the script behind tools/record-traces) gives a fresh recording;
its structure (operations, order, shapes, bytes, FLOP counts, issue order against compute) must equal the
committed trace's, timings aside, and the diagrams and numbers rendered from it must be the same text.
"""

from __future__ import annotations

import pytest

from study import diagrams, estimates, record_traces
from study.traces import load_trace, structure
from tests.launch import ROOT

pytestmark = pytest.mark.freshness

NOTES = ROOT / "reading_notes"
NAMES = [
    "tp_block",
    "tp_block_llama",
    "fsdp_forward",
    "fsdp2_forward",
    "pipeline_gpipe",
    "pipeline_1f1b",
    "pipeline_interleaved",
    "pipeline_zb_h1",
    "pipeline_zbv",
    "pipeline_dualpipev",
]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces") / "reading_notes"
    written = record_traces.record(out / "traces", timeout=240)
    assert sorted(p.stem for p in written) == sorted(NAMES)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_committed_trace_matches_a_fresh_run(fresh, name):
    assert structure(load_trace(fresh, name)) == structure(load_trace(NOTES, name)), (
        f"reading_notes/traces/{name}.json is stale: re-record with tools/record-traces and commit it"
    )


def drawn(notes):
    """Everything a page shows from the traces in `notes`: the diagrams and the estimates."""
    tp, fsdp = load_trace(notes, "tp_block"), load_trace(notes, "fsdp_forward")
    gpipe, one_f_one_b = load_trace(notes, "pipeline_gpipe"), load_trace(notes, "pipeline_1f1b")
    rates = dict(tflops=1, link_GBps=25)
    return (
        diagrams.diagram(tp, link="NVLink"),
        diagrams.diagram(load_trace(notes, "tp_block_llama"), link="NVLink"),
        diagrams.diagram(fsdp, **rates),
        diagrams.diagram(load_trace(notes, "fsdp2_forward"), **rates),
        diagrams.diagram(gpipe, **rates),
        diagrams.diagram(one_f_one_b, **rates),
        diagrams.diagram(load_trace(notes, "pipeline_interleaved"), **rates),
        *(diagrams.diagram(load_trace(notes, f"pipeline_{name}"), **rates) for name in ("zb_h1", "zbv", "dualpipev")),
        estimates.tp_crossover(tp, link_GBps=600, tflops=400, tp=8, bytes_per_element=2),
        estimates.pipeline_memory(gpipe, one_f_one_b, load_trace(NOTES, "scale_70b")),
    )


def test_diagrams_and_numbers_from_a_fresh_run_are_the_committed_ones(fresh):
    assert drawn(fresh) == drawn(NOTES)

"""The site's tables and bar chart from the committed scale traces (reading_notes/traces/scale_*.json) re-check
each row against the formula terms recorded with it when rendered. That the traces are what `python -m
reference.measure.scale` traces now, terms included, is tests/reference/test_scale.py's fresh run."""

from __future__ import annotations

import copy

import pytest

from study import diagrams, scale_tables
from study.traces import TraceError, load_trace
from tests.tools.conftest import ROOT

NOTES = ROOT / "reading_notes"


def test_table_shows_every_row_with_its_formula():
    trace = load_trace(NOTES, "scale_70b")
    table = scale_tables.scale_table(trace)
    assert "| 4 (middle) | TP | all_reduce | 640 | 40.00 GiB | 4 m L x bshe (blocks: 2 fwd, 2 bwd) |" in table
    assert "| 4 (middle) (rank 32) | 40.00 GiB / 70.00 GiB | 4.00 GiB / 2.00 GiB | 1.72 GiB / 3.39 GiB |" in table
    assert "| 4 (middle) | DP | all_reduce | 31 | 1.72 GiB | eP in buckets of >= 25 MiB (DDP grads) |" in table
    assert table.count("\n| 7 (last) | ") == len(trace["runs"][2]["rows"])


def test_bar_chart_draws_the_bytes_each_group_receives_from_the_tables_rows():
    trace = load_trace(NOTES, "scale_70b")
    chart = diagrams.chart_sent_per_group(trace)
    assert chart.startswith("```mermaid\n%%{init: ") and "\nxychart-beta horizontal\n" in chart
    sent = [scale_tables.sent_per_group(trace, run) for run in trace["runs"]]
    (bars,) = [line for line in chart.split("\n") if line.startswith("  bar [")]
    assert bars == "  bar [" + ", ".join(f"{s[g] / 2**30:.2f}" for g in ("tp", "pp", "dp") for s in sent) + "]"
    assert '"TP, stage 4 (middle): 70.00"' in chart and '"DP, stage 4 (middle): 3.39"' in chart  # the table's
    tampered = copy.deepcopy(trace)
    tampered["runs"][1]["rows"][0].update(bytes=1)
    with pytest.raises(TraceError, match="rank 32 tp all_reduce recorded 640 x / 1 B"):  # checked like the table
        diagrams.chart_sent_per_group(tampered)


def test_sent_bytes_follow_ring_algorithms():
    n = 8 * 2**20
    assert [
        scale_tables.sent_bytes(op, n, 8) for op in ("all_reduce", "all_gather", "reduce_scatter", "send", "recv")
    ] == [n * 14 // 8, n * 7 // 8, n * 7 // 8, n, 0]


@pytest.mark.parametrize(
    "tamper, message",
    [
        (
            lambda t: t["runs"][1]["rows"][0].update(bytes=1),
            "rank 32 tp all_reduce recorded 640 x / 1 B but reference.measure.scale.formulas "
            "gives 640 x / 42949672960 B",
        ),
        (
            lambda t: t["runs"][0]["rows"].pop(),
            "rank 0 recorded no dp all_reduce, which reference.measure.scale.formulas",
        ),
        (lambda t: t["runs"][0]["formulas"][0]["terms"][0].update(count=1), "recorded 656 x"),
        (lambda t: t["runs"][2].pop("formulas"), "rank 56 lacks the formulas' terms"),
    ],
    ids=["bytes", "missing-row", "formula", "unrecorded-formulas"],
)
def test_a_trace_that_disagrees_with_the_formulas_is_a_one_line_error(tamper, message):
    trace = copy.deepcopy(load_trace(NOTES, "scale_70b"))
    tamper(trace)
    with pytest.raises(TraceError) as error:
        scale_tables.scale_table(trace)
    assert message in str(error.value) and "re-record with tools/record-traces" in str(error.value)
    assert "\n" not in str(error.value)


def test_memory_table_shows_ddp_against_the_distributed_optimizer_and_refuses_a_stale_trace():
    ddp, zero = load_trace(NOTES, "scale_70b"), load_trace(NOTES, "scale_70b_distopt")
    table = scale_tables.memory_table(ddp, zero)
    assert "| 4 (middle) (rank 32) | fp32 master weights | 3.44 GiB | 55.03 MiB | 0.016 |" in table
    assert "| 4 (middle) (rank 32) | parameters | 1.72 GiB | 1.72 GiB | 1.000 |" in table
    tampered = copy.deepcopy(zero)
    tampered["runs"][1]["memory"]["measured"]["optimizer_states"] += 1
    with pytest.raises(TraceError) as error:
        scale_tables.memory_table(ddp, tampered)
    assert (
        "rank 32 holds 115413121 B of optimizer_states but reference.measure.scale.formulas gives 115413120 B"
        in str(error.value)
        and "\n" not in str(error.value)
    )


def test_hsdp_table_adds_its_two_groups_and_the_held_table_sets_fsdp2_beside_hsdp():
    """The HSDP trace's tables gain the DP shard and DP replicate columns (what a rank sends over each with its
    group's size: 64 and 8 ranks); held_table sets what the FSDP2 and HSDP ranks hold side by side, checked."""
    fsdp2, hsdp = load_trace(NOTES, "scale_70b_fsdp2"), load_trace(NOTES, "scale_70b_hsdp")
    table = scale_tables.scale_table(hsdp)
    assert "DP shard: collective bytes / sent by the rank | DP replicate: collective bytes" in table
    assert "| 0 (only) | DP replicate | all_reduce | 81 | 457.95 MiB |" in table
    sent = scale_tables.sent_per_group(hsdp, hsdp["runs"][0])
    row = next(r for r in hsdp["runs"][0]["rows"] if r["group"] == "dp_replicate")
    assert sent["dp_replicate"] == 2 * 7 * row["bytes"] // 8
    assert "DP shard" not in scale_tables.scale_table(fsdp2)
    held = scale_tables.held_table(fsdp2, hsdp)
    assert "| held | FSDP2 over 512 (rank 0) | HSDP, 8 x 64 (rank 0) |" in held
    assert "| Adam moments | 114.57 MiB | 915.91 MiB |" in held and "| **total** | 229.13 MiB | 1.79 GiB |" in held
    tampered = copy.deepcopy(hsdp)
    tampered["runs"][0]["memory"]["measured"]["gradients"] += 1
    with pytest.raises(TraceError, match="holds 480200193 B of gradients"):
        scale_tables.held_table(fsdp2, tampered)

"""The Scale page's MoE section from the committed MoE traces (reading_notes/traces/moe_scale_*.json): the bytes per
group through the same scale_table and bar chart as the dense traces (EP and expert-DP columns, an all-to-all's
bytes sent from its formula terms), the memory with and without EP, and the imbalance recomputed from the
recorded tokens per expert; a stale trace is a one-line error. That the traces are what `python -m
reference.measure.scale` traces now is tests/reference/test_moe_scale.py's fresh run."""

from __future__ import annotations

import copy

import pytest

from study import diagrams, moe_tables, scale_tables
from study.traces import TraceError, load_trace
from tests.tools.conftest import ROOT

NOTES = ROOT / "reading_notes"


@pytest.fixture
def mixtral():
    return load_trace(NOTES, "moe_scale_mixtral_8x7b")


def test_scale_table_has_the_moe_groups(mixtral):
    table = scale_tables.scale_table(mixtral)
    assert table.startswith("| traced rank (global rank) | EP (all-to-all): collective bytes / sent by the rank | TP:")
    assert "| EP rank 0 (hottest experts) (rank 0) | 22.64 GiB / 18.98 GiB | 58.56 GiB / 29.28 GiB |" in table
    assert "| EP rank 7 (coldest experts) | expert DP | all_reduce | 16 | 1.31 GiB |" in table


def test_all_to_all_sent_bytes_come_from_the_formula_terms(mixtral):
    """What leaves the rank is the all-to-all's input less the rows it keeps: 8 x 7 of the 8 counts, and of
    the 4096 pairs out and 7496 rows back, EP rank 0 keeps its own 937 each way; 128 layer micro-batches."""
    h, n = 4096 * 2, 16 * 8
    sent = scale_tables.sent_per_group(mixtral, mixtral["runs"][0])
    assert sent["ep"] == n * (8 * 7 + 2 * (4096 - 937) * h + 2 * (7496 - 937) * h)
    gathers, reduce_scatters = n * 8 * 2 * 8 + 2 * n * 2 * 7496 * h, 2 * n * 2 * 7496 * h  # counts, rows
    all_reduces = n * 4 * 8 + 8 * 8 * 4096 * 2  # the load-balancing loss's counts, the routers' gradients
    assert sent["tp"] == gathers // 2 + reduce_scatters // 2 + all_reduces  # rings of t = 2
    broken = copy.deepcopy(mixtral)
    for f in broken["runs"][0]["formulas"]:
        for t in f["terms"]:
            t.pop("sent", None)
    with pytest.raises(TraceError, match="all-to-all lacks its bytes sent"):
        scale_tables.sent_per_group(broken, broken["runs"][0])


def test_bar_chart_draws_every_moe_group(mixtral):
    chart = diagrams.chart_sent_per_group(mixtral)
    assert '"EP (all-to-all), EP rank 0 (hottest experts): 18.98"' in chart
    assert '"expert DP, EP rank 7 (coldest experts): 1.31"' in chart
    assert "by process group and rank (moe_scale_mixtral_8x7b)" in chart


def test_memory_and_imbalance_tables():
    mixtral, deepseek = load_trace(NOTES, "moe_scale_mixtral_8x7b"), load_trace(NOTES, "moe_scale_deepseek_v3")
    memory = moe_tables.moe_memory_table(mixtral, deepseek)
    assert memory.startswith(
        "| held | mixtral-8x7b, EP 8 (traced) | mixtral-8x7b, EP 1 | deepseek-v3-moe, EP 64 (traced) |"
    )
    assert "| expert weights | 1.31 GiB | 10.50 GiB | 2.62 GiB | 168.00 GiB |" in memory
    imbalance = moe_tables.moe_imbalance_table(mixtral, deepseek)
    assert (
        "| mixtral-8x7b | 0.5 | 2,048 x 2 = 4,096 | 512 / 937 / 331 | 1.83 | 7,496 (1.83) | 2,648 (0.65) |" in imbalance
    )


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda t: t["routing"]["counts"].__setitem__(0, 936), "routed pairs, not 2048 tokens x top-2"),
        (lambda t: t["routing"].update(expert_max=1), "routing expert_max is 1 but its tokens per expert give 937"),
        (lambda t: t["runs"][0]["memory"]["measured"].update(gradients=1), "holds 1 B of gradients"),
    ],
    ids=["counts", "figure", "memory"],
)
def test_a_stale_moe_trace_is_a_one_line_error(mixtral, tamper, message):
    tamper(mixtral)
    with pytest.raises(TraceError) as error:
        moe_tables.moe_imbalance_table(mixtral)
        moe_tables.moe_memory_table(mixtral)
    assert message in str(error.value) and "\n" not in str(error.value)

"""benchmarks/bench_zero_bubble.py does not rot: one tiny run at pp 2 steps the reference's ZB-V and torch's
ScheduleZBVZeroBubble on the same chunks, and their micro-batch losses are equal. Timings are printed by the
benchmark, never asserted here."""

import pytest

from tests.ranks import on_ranks
from tests.reference.helpers import bench_report

ARGS = ["--hidden-sizes", "16", "32", "--num-layers", "4", "--seq-length", "8", "--micro-batches", "4"]
ARGS += ["--micro-batch-size", "1", "--rounds", "1", "--json", "--device", "cpu"]  # tiny: the test checks the report


@on_ranks(2)
@pytest.mark.upstream("pytorch")  # torch's ScheduleZBVZeroBubble runs in it
def test_bench_zero_bubble_reports_equal_losses_of_reference_and_torch(ranks):
    report = bench_report("bench_zero_bubble.py", ARGS)
    assert report["schedule"] == "zbv" and report["pp"] == 2 and report["device"] == "cpu"
    assert [row["hidden_size"] for row in report["rows"]] == [16, 32]
    for row in report["rows"]:
        assert set(row["median_ms"]) == set(row["min_ms"]) == {"reference", "torch"}
        losses = row["losses"]
        assert len(losses["reference"]) == 4 and losses["reference"] == losses["torch"], row
        assert row["losses_equal"]

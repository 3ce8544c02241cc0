"""benchmarks/bench_ring_attention.py does not rot: one tiny run at cp 2 checks that the reference ring and
torch's `_templated_ring_attention` agree (the benchmark asserts it on its first step) and reports both times
and their ratio, for either of torch's rotaters. Timings are printed by the benchmark, never asserted here."""

import pytest

from tests.ranks import on_ranks
from tests.reference.helpers import bench_report

ARGS = [
    "--num-attention-heads",
    "2",
    "--head-dim",
    "8",
    "--seq-length",
    "16",
    "--batch-size",
    "1",
    "--rounds",
    "1",
    "--json",
]


@on_ranks(2)
@pytest.mark.upstream("pytorch")  # torch's _templated_ring_attention runs in it
@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_bench_ring_attention_reports_reference_and_torch_and_their_ratio(ranks, rotate):
    report = bench_report("bench_ring_attention.py", [*ARGS, "--rotate", rotate])
    assert report["cp"] == 2 and report["device"] == "cpu" and report["rotate"] == rotate
    assert set(report["median_ms"]) == set(report["min_ms"]) == {"reference", "torch"}
    assert set(report["ratios"]) == {"time reference/torch (median)", "time reference/torch (min)"}

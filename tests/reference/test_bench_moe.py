"""benchmarks/bench_moe.py does not rot: one tiny run at EP 2 gives its JSON report, with the reference's five
all-to-alls (counts, tokens and back forward; tokens and back in backward) beside megatron-core's all-gathers
and reduce-scatters. Timings are printed by the benchmark, never asserted here."""

import pytest

from tests.ranks import on_ranks
from tests.reference.helpers import bench_report

ARGS = ["--hidden-size", "16", "--ffn-hidden-size", "32", "--seq-length", "8", "--batch-size", "2"]
ARGS += ["--num-experts", "4", "--rounds", "1", "--json"]  # tiny sizes: the test checks the report


@on_ranks(2)
@pytest.mark.upstream("megatron-lm")  # megatron-core's MoELayer runs in it
def test_bench_moe_reports_both_layers_and_their_collectives(ranks):
    report = bench_report("bench_moe.py", ARGS)
    assert report["ep"] == 2 and report["mode"] == "dropless"
    assert set(report["median_ms"]) == {"reference", "megatron"}
    assert report["ops"]["reference"] == {"all_to_all": 5}
    assert set(report["ops"]["megatron"]) == {"all_gather", "reduce_scatter"}
    assert all(b > 0 for b in report["bytes_per_step"].values())
    assert set(report["ratios"]) == {"time reference/megatron"}

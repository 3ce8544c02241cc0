"""benchmarks/bench_pipeline.py does not rot: one tiny step at world 2 (pp 2) gives its JSON report, with
every variant's loss equal, 1F1B's measured activation peak at the formula's fraction of GPipe's, and the
interleaved variant's chunk-forwards in flight and every variant's replayed bubble at their formulas. Timings are
printed by the benchmark, never asserted here."""

from tests.ranks import on_ranks
from tests.reference.helpers import bench_report

ARGS = ["--hidden-size", "16", "--num-layers", "4", "--seq-length", "8", "--micro-batches", "2"]
ARGS += [  # tiny sizes: the test checks the report
    "--micro-batch-size",
    "1",
    "--steps",
    "1",
    "--warmup",
    "0",
    "--virtual-stages",
    "2",
    "--json",
    "--device",
    "cpu",
]


@on_ranks(2)
def test_bench_pipeline_reports_equal_losses_and_the_1f1b_and_interleaved_memory_formulas(ranks):
    report = bench_report("bench_pipeline.py", ARGS)
    assert report["layout"] == {"tp": 1, "pp": 2, "dp": 1} and report["virtual_stages"] == 2
    assert set(report["variants"]) == {"gpipe", "1f1b", "interleaved"}
    assert set(report["ratios"]) == {"1f1b/gpipe", "interleaved/1f1b"}
    assert report["max_loss_difference"] == 0.0 and len(report["losses"]["interleaved"]) == 2
    for stage in report["stages"]:
        assert stage["gpipe_peak_in_flight_measured"] == 2
        assert stage["1f1b_peak_in_flight_measured"] == min(2 - stage["pp_rank"], 2)
        assert stage["peak_bytes_ratio"] == stage["peak_bytes_ratio_formula"]
        # Megatron's warm-up 2 (p - r - 1) + (v - 1) p, plus the steady state's forward, capped at v m
        assert stage["interleaved_peak_in_flight_measured"] == min(2 * (1 - stage["pp_rank"]) + 2 + 1, 4)
        assert stage["interleaved_bubble_formula"] == 1 / (2 * 2 + 1)
    for variant in report["variants"].values():
        assert 0 < variant["fastest_s"] <= variant["median_s"]
        # the recorded orders replayed with uniform costs idle exactly what the closed forms say
        assert abs(variant["replayed_bubble"] - variant["bubble_formula"]) < 1e-12, variant
    assert report["variants"]["interleaved"]["bubble_formula"] == 1 / 5

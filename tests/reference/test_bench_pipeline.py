"""benchmarks/bench_pipeline.py does not rot: one tiny step at world 2 (pp 2) gives its JSON report, with
every variant's loss equal and 1F1B's measured activation peak at the formula's fraction of GPipe's. Timings
are printed by the benchmark, never asserted here."""
import json

from tests.launch import ROOT, torchrun

TINY = ["--hidden-size", "16", "--num-layers", "2", "--seq-length", "8", "--micro-batches", "2",
        "--micro-batch-size", "1", "--steps", "1", "--warmup", "0", "--json"]


def test_bench_pipeline_reports_equal_losses_and_the_1f1b_memory_formula():
    out = torchrun(ROOT / "benchmarks" / "bench_pipeline.py", 2, *TINY, timeout=120)
    report = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert report["layout"] == {"tp": 1, "pp": 2, "dp": 1}
    assert set(report["variants"]) == {"gpipe", "1f1b"} and set(report["ratios"]) == {"1f1b/gpipe"}
    assert report["max_loss_difference"] == 0.0 and len(report["losses"]["1f1b"]) == 2
    for stage in report["stages"]:
        assert stage["gpipe_peak_in_flight_measured"] == 2
        assert stage["1f1b_peak_in_flight_measured"] == min(2 - stage["pp_rank"], 2)
        assert stage["peak_bytes_ratio"] == stage["peak_bytes_ratio_formula"]
    for variant in report["variants"].values():
        assert 0 < variant["fastest_s"] <= variant["median_s"]

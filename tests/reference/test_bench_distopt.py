"""benchmarks/bench_distopt.py does not rot: one tiny step at world 2 gives its JSON report, with equal losses
and bytes per rank at their closed forms. Timings are printed by the benchmark, never asserted here."""

from tests.ranks import on_ranks
from tests.reference.helpers import bench_report

ARGS = ["--hidden-size", "16", "--num-layers", "1", "--seq-length", "4", "--batch-size", "1", "--steps", "1"]
ARGS += ["--json"]  # tiny sizes: the test checks the report


@on_ranks(2)
def test_bench_distopt_reports_equal_losses_and_bytes_at_the_closed_forms(ranks):
    report = bench_report("bench_distopt.py", ARGS)
    assert report["world"] == 2 and report["max_loss_difference"] == 0.0
    assert set(report["variants"]) == {"ddp", "distopt", "distopt overlap"}
    for variant in report["variants"].values():
        assert variant["total_bytes"] == variant["formula_bytes"] == sum(variant["bytes"].values())
    ddp, distopt = report["variants"]["ddp"], report["variants"]["distopt"]
    assert set(ddp["collectives"]) == {"all_reduce"} and set(distopt["collectives"]) == {"reduce_scatter", "all_gather"}
    # at N = 2 a ring sends half of a buffer per reduce-scatter or all-gather and all of it per all-reduce:
    # DDP 2 x 4Ψ / 2 (fp32 gradients), the distributed optimizer (4Ψ + 2Ψ) / 2 (bf16 parameters)
    assert ddp["ring_bytes_per_rank"] == 4 * report["psi"]
    assert distopt["ring_bytes_per_rank"] == 3 * report["psi_padded"]

"""benchmarks/bench_fsdp2.py does not rot: one tiny run at world 2 gives its JSON report, the reference FSDP2
and `fully_shard` side by side in every configuration, moving the same bytes and holding the same shards.
Timings are printed by the benchmark, never asserted here."""

from tests.ranks import on_ranks
from tests.reference.helpers import bench_report

ARGS = ["--hidden-size", "16", "--num-attention-heads", "2", "--num-layers", "2", "--seq-length", "8"]
ARGS += ["--global-batch-size", "2", "--steps", "1", "--rounds", "1", "--json"]  # tiny: the test checks the report


@on_ranks(2)
def test_bench_fsdp2_reports_both_implementations_with_equal_bytes(ranks):
    report = bench_report("bench_fsdp2.py", ARGS)
    assert report["world"] == 2 and report["target_vs_fsdp2"] == 1.1
    rows = {(r["config"], r["implementation"]): r for r in report["rows"]}
    assert set(rows) == {(c, i) for c in ("fp32", "bf16", "fwd prefetch") for i in ("reference-fsdp2", "fsdp2")}
    for config in ("fp32", "bf16", "fwd prefetch"):
        ours, theirs = rows[config, "reference-fsdp2"], rows[config, "fsdp2"]
        assert ours["collectives"] == theirs["collectives"] and set(ours["collectives"]) == {
            "all_gather",
            "reduce_scatter",
        }
        assert ours["param_bytes_per_rank"] == theirs["param_bytes_per_rank"] > 0
        assert ours["vs_fsdp2"] == ours["step_ms"] / theirs["step_ms"] and theirs["vs_fsdp2"] == 1.0

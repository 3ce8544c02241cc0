"""benchmarks/bench_tp.py does not rot: one tiny run at TP 2 gives its JSON report, and the reference (with its
two flag variants) and megatron-core's parallel linear layers send the bytes the formula says: 4 all-reduces
of N per layer, or with SP 10 gathers and scatters plus the entry/exit gather; DTensor's plan, with SP, one
all-gather fewer per column layer. Timings are printed by the benchmark, never asserted here."""

import pytest

from tests.ranks import on_ranks
from tests.reference.helpers import bench_report

ARGS = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8", "--batch-size", "2"]
ARGS += ["--num-layers", "2", "--rounds", "1", "--json"]  # tiny sizes: the test checks the report


@on_ranks(2)
@pytest.mark.upstream("megatron-lm")  # megatron-core's ColumnParallelLinear / RowParallelLinear run in it
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_bench_tp_reports_the_formulas_bytes_for_every_implementation(ranks, sp):
    report = bench_report("bench_tp.py", [*ARGS, *(["--sequence-parallel"] if sp else [])])
    assert report["tp"] == 2 and report["sequence_parallel"] == sp
    n = 2 * 8 * 32 * 4  # b * s * h fp32 bytes
    assert report["formula_bytes"] == (10 * 2 + 1 if sp else 4 * 2) * n
    megatron_style = ["reference", "ref-sync", "ref-fusion", "megatron"]
    # With SP, DTensor keeps each column layer's gathered input for backward where Megatron re-gathers it:
    # one all-gather of N fewer per column layer, two per block.
    dtensor = report["formula_bytes"] - (2 * 2 * n if sp else 0)
    assert report["bytes_per_step"] == {**dict.fromkeys(megatron_style, report["formula_bytes"]), "dtensor": dtensor}
    assert set(report["ratios"]) == {"time reference/megatron", "time reference/dtensor"}

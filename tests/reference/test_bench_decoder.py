"""benchmarks/bench_decoder.py does not rot: one tiny run at TP 2 gives its JSON report with the reference's
loss equal to HF Qwen2's under the document's DTensor plan. Bytes per step: without SP the reference sends
fewer (DTensor all-reduces each column layer's input gradient on its own, q, k, v and gate, up separately,
where the reference's fused layers reduce once); with SP it sends more (Megatron's column layers re-gather
their sequence-split input in backward for the weight gradient instead of keeping the gathered copy, which
DTensor's autograd saves). Timings are printed by the benchmark, never asserted here."""

import pytest

from tests.ranks import on_ranks
from tests.reference.helpers import bench_report

ARGS = ["--hidden-size", "32", "--num-attention-heads", "4", "--num-kv-heads", "2", "--seq-length", "8"]
ARGS += ["--vocab-size", "64", "--rounds", "1", "--json"]  # tiny sizes: the test checks the report


@on_ranks(2)
@pytest.mark.upstream("pytorch")  # the comparison runs torch's DTensor plan on HF Qwen2
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_bench_decoder_reports_equal_losses_and_fewer_reference_bytes(ranks, sp):
    report = bench_report("bench_decoder.py", [*ARGS, *(["--sequence-parallel"] if sp else [])])
    assert report["tp"] == 2 and report["sequence_parallel"] == sp
    assert report["losses"]["reference"] == pytest.approx(report["losses"]["hf"], abs=1e-5)
    ours, theirs = report["bytes_per_step"]["reference"], report["bytes_per_step"]["hf"]
    assert (ours > theirs) if sp else (0 < ours < theirs), report["bytes_per_step"]
    assert set(report["ratios"]) == {"time reference/hf", "bytes reference/hf"}

"""The TP transformer against PyTorch DTensor TP (ColwiseParallel / RowwiseParallel / SequenceParallel)
applied to the plain transformer: equal numbers, and collective counts that agree with CommDebugMode."""
import json
from pathlib import Path

import pytest

from tests.launch import torchrun
from tests.reference.gpus import CUDA_ENV, require_gpus

WORKER = Path(__file__).parent / "workers" / "tp_vs_dtensor_worker.py"


def test_tp_transformer_matches_dtensor_tp():
    out = torchrun(WORKER, 2, timeout=180)
    assert out.count("dtensor comparisons ok") == 2
    counts = {c["sequence_parallel"]: c for c in
              (json.loads(line.split("COUNTS ", 1)[1]) for line in out.splitlines() if "COUNTS " in line)}
    # 2 layers: without SP both issue 2 all-reduces per block each way
    assert counts[False]["reference"] == counts[False]["dtensor"] == {
        "forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}
    # with SP the forward is identical (an all-gather + reduce-scatter per column/row pair, plus the exit
    # gather); in backward the reference re-gathers each column layer's input (Megatron's memory saving)
    # where DTensor keeps the gathered activation: one more all-gather per column layer, 2 per block
    assert counts[True]["reference"]["forward"] == counts[True]["dtensor"]["forward"] == {
        "all_gather": 5, "reduce_scatter": 4}
    assert counts[True]["dtensor"]["backward"] == {"all_gather": 5, "reduce_scatter": 4}
    assert counts[True]["reference"]["backward"] == {"all_gather": 5 + 4, "reduce_scatter": 4}


@pytest.mark.cuda
def test_tp_transformer_matches_dtensor_tp_cuda():
    require_gpus(2)
    out = torchrun(WORKER, 2, timeout=180, env=CUDA_ENV)
    assert out.count("dtensor comparisons ok") == 2

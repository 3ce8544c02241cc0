"""The collective recorder on real collectives (gloo; NCCL when GPUs are present), eager c10d, functional
(DTensor-style), FSDP1 and FSDP2, at world size 2 (TP groups at 4 and 64 ranks are covered by the TP tests)."""
from pathlib import Path

import pytest

from tests.launch import torchrun
from tests.reference.gpus import CUDA_ENV, require_gpus

WORKER = Path(__file__).parent / "workers" / "recorder_worker.py"


def test_recorder_records_every_collective_kind():
    out = torchrun(WORKER, 2, timeout=120)
    assert out.count("check_phase_module_and_spans ok") == 2 and out.count("check_flop_stamps ok") == 2


@pytest.mark.cuda
def test_recorder_records_every_collective_kind_cuda():
    require_gpus(2)
    out = torchrun(WORKER, 2, timeout=120, env=CUDA_ENV)
    assert out.count("check_phase_module_and_spans ok") == 2

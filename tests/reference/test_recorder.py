"""The collective recorder, on real gloo collectives at world sizes 2 and 4."""
from pathlib import Path

import pytest

from tests.launch import torchrun
from tests.reference.gpus import CUDA_ENV, require_gpus

WORKER = Path(__file__).parent / "workers" / "recorder_worker.py"


@pytest.mark.parametrize("world", [2, 4])
def test_recorder_records_every_collective_kind(world):
    out = torchrun(WORKER, world, timeout=120)
    assert out.count("check_phase_module_and_spans ok") == world


@pytest.mark.cuda
def test_recorder_records_every_collective_kind_cuda():
    require_gpus(2)
    out = torchrun(WORKER, 2, timeout=120, env=CUDA_ENV)
    assert out.count("check_phase_module_and_spans ok") == 2

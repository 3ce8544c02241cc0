"""The PP x DP x TP rank grid: the same groups as megatron-core's initialize_model_parallel, at world 4."""
from pathlib import Path

import pytest

from tests.launch import torchrun
from tests.reference.gpus import CUDA_ENV, require_gpus

WORKER = Path(__file__).parent / "workers" / "parallel_state_worker.py"


def test_layout_groups_match_megatron_core():
    out = torchrun(WORKER, 4, timeout=120)
    assert out.count("parallel_state ok") == 4
    assert "world 4 = pp 2 x dp 1 x tp 2 (TP groups are consecutive ranks)" in out
    assert "  tp group 1: [2, 3]" in out and "  pp group 0: [0, 2]" in out


@pytest.mark.cuda
def test_layout_groups_match_megatron_core_cuda():
    require_gpus(4)
    out = torchrun(WORKER, 4, timeout=120, env=CUDA_ENV)
    assert out.count("parallel_state ok") == 4

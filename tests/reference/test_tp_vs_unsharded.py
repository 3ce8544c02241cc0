"""The TP transformer equals the unsharded one built from the same master weights (world sizes 1, 2, 4).

Outputs, input gradients and every weight gradient (re-assembled from the shards) match for 3 SGD steps,
with and without sequence parallelism, overlap and gradient-accumulation fusion, and with a padded sequence.
"""
from pathlib import Path

import pytest

from tests.launch import torchrun
from tests.reference.gpus import CUDA_ENV, require_gpus

WORKER = Path(__file__).parent / "workers" / "tp_vs_unsharded_worker.py"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_tp_transformer_matches_unsharded_for_several_steps(world):
    out = torchrun(WORKER, world, timeout=180)
    assert out.count("unsharded comparisons ok") == world


@pytest.mark.cuda
@pytest.mark.parametrize("world", [1, 2])
def test_tp_transformer_matches_unsharded_for_several_steps_cuda(world):
    require_gpus(world)
    out = torchrun(WORKER, world, timeout=180, env=CUDA_ENV)
    assert out.count("unsharded comparisons ok") == world

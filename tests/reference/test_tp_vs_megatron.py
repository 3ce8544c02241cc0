"""reference against megatron-core 0.16.1 (one launch per world size, megatron's import is slow):

* the PP x DP x TP process groups equal those of megatron's initialize_model_parallel, for every split;
* ColumnParallelLinear / RowParallelLinear: same seed, same shards, same outputs and gradients, and the
  identical recorded collective sequence (op, group, shape, bytes, dtype, phase, async), over bias /
  skip_bias_add / gather_output / input_is_parallel / sequence_parallel.
"""
from pathlib import Path

import pytest

from tests.reference.gpus import WORLDS, launch_world, world_id

WORKER = Path(__file__).parent / "workers" / "tp_vs_megatron_worker.py"


@pytest.fixture(scope="module", params=WORLDS, ids=world_id)
def run(request):
    return launch_world(request.param, WORKER)


def test_layout_groups_match_megatron_core(run):
    world, out = run
    assert out.count("parallel_state layouts ok") == world
    assert f"world {world} = tp {world} x pp 1 x dp 1, order tp-dp-pp" in out
    if world == 4:
        assert "world 4 = tp 2 x pp 2 x dp 1, order tp-dp-pp" in out
        assert "  tp groups: [0,1] [2,3]\n  pp groups: [0,2] [1,3]\n  dp groups: [0] [1] [2] [3]" in out


def test_parallel_linear_layers_match_megatron_core(run):
    world, out = run
    assert out.count("megatron comparisons ok") == world

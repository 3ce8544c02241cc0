"""reference against megatron-core 0.16.1 (one launch per world size, megatron's import is slow):

* the PP x DP x TP process groups equal those of megatron's initialize_model_parallel, for every split;
* ColumnParallelLinear / RowParallelLinear: same seed, same shards, same outputs and gradients (asserted per
  tensor on every rank by workers/tp_vs_megatron_worker.py), and the identical recorded collective sequence
  (op, group, shape, bytes, dtype, phase, async), over bias / skip_bias_add / gather_output /
  input_is_parallel / sequence_parallel.
"""

import pytest

from tests.launch import run_worker
from tests.reference.gpus import WORLDS, world_id

# (bias, skip_bias_add) pairs x gather_output / input_is_parallel x sequence_parallel, as the worker loops:
COLUMN_CASES, ROW_CASES = 3 * 2 * 2, 3 * 2 * 2 - 3  # a row layer's sequence parallelism needs a parallel input


@pytest.fixture(scope="module", params=WORLDS, ids=world_id)
def run(request):
    world, device = request.param
    return world, run_worker("tp_vs_megatron_worker.py", world, device=device, timeout=180)


def test_layout_groups_match_megatron_core(run):
    world, results = run
    for rank, result in enumerate(results):
        for layout in result["layouts"]:
            what = f"{layout['order']} tp={layout['tp']} pp={layout['pp']} rank {rank}"
            for name, (mine, megatron) in layout["groups"].items():
                assert mine == megatron, f"{what}: {name} group {mine} vs megatron {megatron}"
            assert layout["ranks"][0] == layout["ranks"][1], f"{what}: (tp rank, dp rank)"
            tp = layout["tp"]
            assert layout["tp_rank_sum"] == sum(range(rank - rank % tp, rank - rank % tp + tp)), what
    described = [layout["describe"] for layout in results[0]["layouts"]]
    assert any(f"world {world} = tp {world} x pp 1 x dp 1, order tp-dp-pp" in d for d in described)
    if world == 4:
        assert any("world 4 = tp 2 x pp 2 x dp 1, order tp-dp-pp" in d for d in described)
        assert any(
            "  tp groups: [0,1] [2,3]\n  pp groups: [0,2] [1,3]\n  dp groups: [0] [1] [2] [3]" in d for d in described
        )


def test_parallel_linear_layers_match_megatron_core(run):
    world, results = run
    for result in results:
        assert len(result["layers"]) == COLUMN_CASES + ROW_CASES
        for layer in result["layers"]:
            assert layer["reference"] == layer["megatron"], f"{layer['what']}: collectives differ"
            assert len(layer["reference"]) > 0 or world == 1
        assert result["shards_equal_megatron_master"]

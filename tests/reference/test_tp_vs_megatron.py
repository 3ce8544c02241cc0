"""ColumnParallelLinear / RowParallelLinear equal megatron-core 0.16.1's: same seed, same shards, same
outputs and gradients, and the identical recorded collective sequence (op, group, shape, bytes, dtype,
phase, async), over bias / skip_bias_add / gather_output / input_is_parallel / sequence_parallel."""
from pathlib import Path

import pytest

from tests.launch import torchrun

WORKER = Path(__file__).parent / "workers" / "tp_vs_megatron_worker.py"


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_linear_layers_match_megatron_core(world):
    out = torchrun(WORKER, world, timeout=180)
    assert out.count("megatron comparisons ok") == world

"""The collective recorder, on real gloo collectives at world sizes 2 and 4."""
from pathlib import Path

import pytest

from tests.launch import torchrun

WORKER = Path(__file__).parent / "workers" / "recorder_worker.py"


@pytest.mark.parametrize("world", [2, 4])
def test_recorder_records_every_collective_kind(world):
    out = torchrun(WORKER, world, timeout=120)
    assert out.count("check_phase_module_and_spans ok") == world

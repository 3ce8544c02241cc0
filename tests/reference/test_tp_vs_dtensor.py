"""The TP transformer against PyTorch DTensor TP (ColwiseParallel / RowwiseParallel / SequenceParallel)
applied to the plain transformer: equal numbers (asserted on every rank by workers/tp_vs_dtensor_worker.py),
and collective counts that agree with CommDebugMode."""

import pytest

from tests.launch import run_worker
from tests.reference.gpus import DEVICES

pytestmark = pytest.mark.parametrize("device", DEVICES)


def runs(device: str) -> list[dict]:
    return run_worker("tp_vs_dtensor_worker.py", 2, device=device, timeout=180)


@pytest.mark.parametrize("config", ["tp", "sp"])
def test_recorder_counts_equal_comm_debug_mode(device, config):
    for result in runs(device):
        run = result[config]
        assert run["reference_all"] == run["comm_debug"]["reference"]["all"]
        assert run["dtensor_all"] == run["comm_debug"]["dtensor"]["all"]
        assert run["dtensor"]["forward"] == run["comm_debug"]["dtensor"]["forward"]
        assert len(run["grads_compared"]) == 2 * 12  # 2 layers of 12 parameters, each equal to DTensor's


def test_tp_transformer_matches_dtensor_tp(device):
    counts = runs(device)[0]
    # 2 layers: without SP both issue 2 all-reduces per block each way
    assert (
        counts["tp"]["reference"]
        == counts["tp"]["dtensor"]
        == {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}
    )
    # with SP the forward is identical (an all-gather + reduce-scatter per column/row pair, plus the exit
    # gather); in backward the reference re-gathers each column layer's input (Megatron's memory saving)
    # where DTensor keeps the gathered activation: one more all-gather per column layer, 2 per block
    assert (
        counts["sp"]["reference"]["forward"]
        == counts["sp"]["dtensor"]["forward"]
        == {"all_gather": 5, "reduce_scatter": 4}
    )
    assert counts["sp"]["dtensor"]["backward"] == {"all_gather": 5, "reduce_scatter": 4}
    assert counts["sp"]["reference"]["backward"] == {"all_gather": 5 + 4, "reduce_scatter": 4}

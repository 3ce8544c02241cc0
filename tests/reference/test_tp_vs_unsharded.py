"""The TP transformer equals the unsharded one built from the same master weights (world sizes 1, 2, 4).

Outputs, input gradients and every weight gradient (re-assembled from the shards) match for 3 SGD steps,
with and without sequence parallelism, overlap and gradient-accumulation fusion, and with a padded sequence.
"""

import pytest

from tests.launch import run_worker


def configurations(world: int) -> list[str]:
    """What the worker compares at `world`: every flag combination at 2, four covering each flag both ways at
    1 and 4, and (TP > 1) sequence parallelism with a padded sequence of 8 * world + 1."""
    if world == 2:
        flags = [(sp, overlap, fusion) for sp in (False, True) for overlap in (True, False) for fusion in (False, True)]
    else:
        flags = [(False, True, False), (True, True, True), (True, False, False), (False, False, True)]
    names = [f"sp={sp} overlap={overlap} fusion={fusion} seq=8" for sp, overlap, fusion in flags]
    return names + ([f"sp=True overlap=True fusion=False seq={8 * world + 1}"] if world > 1 else [])


@pytest.mark.parametrize(
    "world, device",
    [
        (1, "cpu"),
        (2, "cpu"),
        (4, "cpu"),
        pytest.param(1, "cuda", marks=pytest.mark.cuda),
        pytest.param(2, "cuda", marks=pytest.mark.cuda),
    ],
)
def test_tp_transformer_matches_unsharded_for_several_steps(world, device):
    for result in run_worker("tp_vs_unsharded_worker.py", world, device=device, timeout=180):
        assert result["compared"] == configurations(world)

"""The recorded collective schedule of the reference FSDP is FSDP1's, unit by unit, for every policy.

Both runs are recorded by `reference.measure.recorder.CollectiveRecorder`; FSDP1's collectives are attributed to
units by `reference.measure.fsdp_tracing.torch_fsdp1_unit_scopes`. Compared per step: op, unit, phase, bytes and
dtype of every collective in issue order, so prefetch decisions, the root's kept parameters and the
16-byte alignment padding (flat sizes) must all agree.
"""

from __future__ import annotations

import pytest

from tests.reference.fsdp_runs import fsdp_results, schedule

CONFIGS = ["pre", "pre+fwd", "post", "post+fwd", "none", "none+fwd", "bf16"]


@pytest.mark.parametrize("world, device", [(2, "cpu"), (4, "cpu"), pytest.param(2, "cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("config", CONFIGS)
def test_allgather_and_reduce_scatter_order_per_unit_matches_fsdp1(world, config, device):
    for result in fsdp_results(world, device):
        ours, theirs = result["runs"][f"reference/{config}"], result["runs"][f"fsdp1/{config}"]
        for step, (a, b) in enumerate(zip(ours["steps"], theirs["steps"], strict=True)):
            assert schedule(a) == schedule(b), f"{config} step {step} rank {result['rank']}"
            assert {e[1] for e in schedule(a)} == {"root", "layers.0", "layers.1", "layers.2"}


@pytest.mark.parametrize("world", [2, 4])
def test_shard_sizes_equal_fsdp1_flat_parameter_shards(world):
    for result in fsdp_results(world):
        ours = {u["name"]: u["shard_numel"] for u in result["runs"]["reference/pre"]["units"]}
        assert ours == result["runs"]["fsdp1/pre"]["shard_numel"]


def test_backward_prefetch_changes_the_backward_schedule():
    """Prefetching moves unit l-1's all-gather before unit l's reduce-scatter (so the equality above is not
    vacuous). BACKWARD_PRE and BACKWARD_POST issue the same sequence; they differ in where it falls
    relative to the gradient computation (test_fsdp_claims.py)."""
    steps = {
        c: schedule(fsdp_results(2)[0]["runs"][f"reference/{c}"]["steps"][1], "backward")
        for c in ("pre", "post", "none")
    }
    assert steps["pre"] == steps["post"] != steps["none"]

"""The recorded collective schedule of the reference FSDP is FSDP1's, unit by unit, for every policy.

Both runs are recorded by `reference.measure.recorder.CollectiveRecorder`; FSDP1's collectives are attributed to
units by `reference.measure.fsdp_tracing.torch_fsdp1_unit_scopes`. Compared per step: op, unit, phase, bytes and
dtype of every collective in issue order, so prefetch decisions, the root's kept parameters and the
16-byte alignment padding (flat sizes) must all agree.
"""

from __future__ import annotations

import pytest

from tests.ranks import on_ranks
from tests.reference.fsdp_runs import fsdp_results, schedule
from tests.reference.gpus import DEVICES

CONFIGS = ["pre", "pre+fwd", "post", "post+fwd", "none", "none+fwd", "bf16"]


@on_ranks(2, 4, devices=DEVICES)  # CUDA: 2 GPUs
@pytest.mark.parametrize("config", CONFIGS)
def test_allgather_and_reduce_scatter_order_per_unit_matches_fsdp1(ranks, config):
    result = fsdp_results(ranks.device)
    ours, theirs = result["runs"][f"reference/{config}"], result["runs"][f"fsdp1/{config}"]
    for step, (a, b) in enumerate(zip(ours["steps"], theirs["steps"], strict=True)):
        assert schedule(a) == schedule(b), f"{config} step {step}"
        assert {e[1] for e in schedule(a)} == {"root", "layers.0", "layers.1", "layers.2"}


@on_ranks(2, 4)
def test_shard_sizes_equal_fsdp1_flat_parameter_shards(ranks):
    runs = fsdp_results(ranks.device)["runs"]
    assert {u["name"]: u["shard_numel"] for u in runs["reference/pre"]["units"]} == runs["fsdp1/pre"]["shard_numel"]


@on_ranks(2)
def test_backward_prefetch_changes_the_backward_schedule(ranks):
    """Prefetching moves unit l-1's all-gather before unit l's reduce-scatter (so the equality above is not
    vacuous). BACKWARD_PRE and BACKWARD_POST issue the same sequence; they differ in where it falls
    relative to the gradient computation (test_fsdp_claims.py)."""
    runs = fsdp_results(ranks.device)["runs"]
    steps = {c: schedule(runs[f"reference/{c}"]["steps"][1], "backward") for c in ("pre", "post", "none")}
    assert steps["pre"] == steps["post"] != steps["none"]

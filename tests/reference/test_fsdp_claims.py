"""The claims the FSDP notes make, each demonstrated on a recorded run of the reference (world 2, CPU/gloo).

Times come from `CollectiveRecorder`: a collective's `start` is when it was issued; spans "<unit> forward"
(the wrapped module's forward) and "<unit> backward" (pre-backward hook, after the unit's own all-gather
landed, to post-backward hook) are recorded by `reference.measure.fsdp_tracing`. Units: root (embedding, final
norm, output layer) and layers.0-2. Steps 1 and 2 are checked (step 0 records the forward order). The timing claims
also run on CUDA/NCCL (2 GPUs), where each all-gather runs on NCCL's stream and `Work.wait()` only makes the
compute stream wait, so the prefetched all-gathers overlap compute on the GPU.
"""

from __future__ import annotations

import pytest

from tests.ranks import on_ranks
from tests.reference.fsdp_runs import fsdp_results, issued, schedule, span
from tests.reference.gpus import DEVICES

LAYERS = ["layers.0", "layers.1", "layers.2"]
FORWARD_PAIRS = list(zip(["root"] + LAYERS[:-1], LAYERS))  # (unit l, unit l+1)
BACKWARD_PAIRS = [("layers.2", "layers.1"), ("layers.1", "layers.0")]  # (current, next in backward)


def steps(config: str, ranks):
    return fsdp_results(ranks.device)["runs"][f"reference/{config}"]["steps"][1:]


@on_ranks(2, devices=DEVICES)
def test_forward_prefetch_issues_next_allgather_before_current_compute_ends(ranks):
    for step in steps("pre+fwd", ranks):
        for current, following in FORWARD_PAIRS:
            assert issued(step, "all_gather", following, "forward") < span(step, f"{current} forward")["end"]
            # ...indeed before it starts: the prefetch is issued from unit l's pre-forward.
            assert issued(step, "all_gather", following, "forward") < span(step, f"{current} forward")["start"]
    for step in steps("pre", ranks):  # without forward prefetch, unit l+1 is gathered only after unit l computed
        for current, following in FORWARD_PAIRS[1:]:
            assert issued(step, "all_gather", following, "forward") > span(step, f"{current} forward")["end"]


@on_ranks(2, devices=DEVICES)
def test_forward_prefetch_uses_execution_order_recorded_in_first_iteration(ranks):
    """Step 0 cannot know the next unit yet, so it gathers on demand; later steps prefetch."""
    first = fsdp_results(ranks.device)["runs"]["reference/pre+fwd"]["steps"][0]
    for current, following in FORWARD_PAIRS[1:]:
        assert issued(first, "all_gather", following, "forward") > span(first, f"{current} forward")["end"]


@on_ranks(2, devices=DEVICES)
def test_backward_pre_prefetch_issues_next_allgather_before_current_reduce_scatter(ranks):
    for step in steps("pre", ranks):
        assert issued(step, "all_gather", "layers.2", "backward") < span(step, "root backward")["start"]
        for current, following in BACKWARD_PAIRS:
            gathered = issued(step, "all_gather", following, "backward")
            assert gathered < issued(step, "reduce_scatter", current, "backward")
            assert gathered < span(step, f"{current} backward")["start"]  # before its gradient computation


@on_ranks(2, devices=DEVICES)
def test_backward_post_prefetch_issues_next_allgather_after_current_gradient_before_its_reduce_scatter(ranks):
    for step in steps("post", ranks):
        for current, following in BACKWARD_PAIRS:
            gathered = issued(step, "all_gather", following, "backward")
            reduced = issued(step, "reduce_scatter", current, "backward")
            assert span(step, f"{current} backward")["end"] <= gathered < reduced


@on_ranks(2, devices=DEVICES)
def test_without_backward_prefetch_next_allgather_follows_current_reduce_scatter(ranks):
    for step in steps("none", ranks):
        for current, following in BACKWARD_PAIRS:
            reduced = issued(step, "reduce_scatter", current, "backward")
            assert issued(step, "all_gather", following, "backward") > reduced


# Most blocks ever unsharded at once, per policy (the root stays unsharded from its forward to its
# post-backward, as in FSDP1). On demand: one. Forward prefetch: the current and the next block. BACKWARD_PRE:
# the current and the prefetched one; with forward prefetch, the views of block l-1 were created earlier, so
# autograd runs block l-1's pre-backward hook (which prefetches block l-2) before block l's post-backward
# hook has freed block l: three. The same schedule as FSDP1 (test_fsdp_schedule.py), so the same memory.
MAX_BLOCKS_UNSHARDED = {"none": 1, "post": 1, "pre": 2, "none+fwd": 2, "post+fwd": 2, "pre+fwd": 3}


@on_ranks(2, devices=DEVICES)
@pytest.mark.parametrize("config", sorted(MAX_BLOCKS_UNSHARDED))
def test_unit_full_parameters_never_outlive_its_forward_or_backward(ranks, config):
    """Unsharded bytes of every unit, sampled at every aten op of forward+backward (a dispatch mode)."""
    run = fsdp_results(ranks.device)["runs"][f"reference/{config}"]
    full = [u["full_bytes"] for u in run["units"]]
    assert [u["name"] for u in run["units"]] == ["root"] + LAYERS
    for step in run["steps"][1:]:
        samples = step["memory_samples"]
        assert samples[0] == [full[0], 0, 0, 0], "only the root is gathered before the first block"
        assert samples[-1] == [0] * len(full), "everything is resharded when backward ends"
        for unit in range(1, len(full)):  # a block is allocated once for forward, once for backward
            allocated = [sample[unit] for sample in samples]
            assert set(allocated) == {0, full[unit]}
            gathers = sum(1 for before, now in zip([0] + allocated, allocated) if now and not before)
            assert gathers == 2, (config, unit, allocated)
        blocks_at_once = max(sum(1 for b in sample[1:] if b) for sample in samples)
        assert blocks_at_once == MAX_BLOCKS_UNSHARDED[config]
        assert max(map(sum, samples)) == full[0] + blocks_at_once * full[1]


@on_ranks(2, 4)
def test_per_rank_parameter_memory_is_one_nth_of_total_plus_padding(ranks):
    world = ranks.world
    run = fsdp_results(ranks.device)["runs"]["reference/pre"]
    units = run["units"]
    for unit in units:
        assert unit["shard_numel"] * world == unit["padded_numel"] >= unit["numel"] >= unit["param_numel"]
        assert unit["padded_numel"] - unit["numel"] < world  # end padding to a multiple of N
        assert unit["numel"] - unit["param_numel"] < 4 * 16  # 16-byte alignment, < 4 each here
    total = sum(u["param_numel"] * u["itemsize"] for u in units)
    padding = sum((u["padded_numel"] - u["param_numel"]) * u["itemsize"] for u in units)
    assert run["param_bytes_per_rank"] == (total + padding) // world
    assert padding > 0  # odd flat sizes: padded, never a crash


@on_ranks(2, 4)
@pytest.mark.parametrize("config", ["pre+fwd", "bf16"])
def test_bytes_per_step_are_two_allgathers_and_one_reduce_scatter_of_each_flat_size(ranks, config):
    """Per block unit: all-gather (forward) + all-gather (backward) + reduce-scatter of the padded flat
    size. The root gathers once: as in FSDP1 (`_post_forward_reshard`), it keeps its parameters between
    forward and backward because its backward starts immediately."""
    run = fsdp_results(ranks.device)["runs"][f"reference/{config}"]
    param_size, reduce_size = (2, 4) if config == "bf16" else (4, 4)
    for step in run["steps"]:
        for unit in run["units"]:
            events = [e for e in schedule(step) if e[1] == unit["name"]]
            gathers = 1 if unit["name"] == "root" else 2
            assert [e[0] for e in events] == ["all_gather"] * gathers + ["reduce_scatter"]
            assert [e[3] for e in events] == (
                [unit["padded_numel"] * param_size] * gathers + [unit["padded_numel"] * reduce_size]
            )

"""The reference's zero-bubble orders (reference.pipeline.zero_bubble) against torch's own schedule objects.

torch plans every rank's order in the schedule's constructor, which reads only the stages' num_stages,
group_size and group_rank (and that no stage module is torch.compile'd): stand-in stages build
ScheduleInterleavedZeroBubble (one stage per rank: ZB-H1), ScheduleZBVZeroBubble and ScheduleDualPipeV in
one process, no process group. `pipeline_order[rank]` is compared with the idle slots (None) dropped.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _ComputationType,
)

from reference.parallel_state import ParallelConfigError
from reference.pipeline.zero_bubble import Action, Overlap, check_zero_bubble, rank_order, stages_of

pytestmark = pytest.mark.upstream("pytorch")

TORCH = {"zb-h1": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}


def torch_orders(schedule: str, p: int, m: int) -> dict[int, list[Action | Overlap]]:
    """Every rank's compute order as torch plans it, in the reference's types."""
    local = len(stages_of(schedule, p, 0))
    stages = [
        SimpleNamespace(num_stages=p * local, group_size=p, group_rank=0, submod=None, stage_index=s)
        for s in range(local)
    ]
    plan = TORCH[schedule](stages, m).pipeline_order

    def ours(action):
        if action.computation_type == _ComputationType.OVERLAP_F_B:
            return Overlap(*map(ours, action.sub_actions))
        return Action(action.computation_type.value, action.stage_index, action.microbatch_index)

    return {r: [ours(a) for a in plan[r] if a is not None] for r in range(p)}


# torch's interleaved zero bubble needs m a multiple of its rounds, max(1, m // p)
CASES = {
    "zb-h1": [(2, 1), (2, 2), (2, 4), (3, 3), (3, 6), (4, 4), (4, 8), (4, 3)],
    "zbv": [(2, 1), (2, 3), (2, 4), (2, 8), (3, 2), (3, 5), (3, 6), (4, 8), (4, 11)],
    "dualpipev": [(2, 4), (2, 5), (2, 8), (3, 6), (3, 9), (4, 8), (4, 10), (5, 12)],
}


@pytest.mark.parametrize(("schedule", "p", "m"), [(s, p, m) for s, cases in CASES.items() for p, m in cases])
def test_zero_bubble_orders_equal_torch_schedules(schedule, p, m):
    expected = torch_orders(schedule, p, m)
    for r in range(p):
        assert rank_order(schedule, p, r, m) == expected[r], (schedule, p, m, r)


def test_zbv_rank0_order_at_pp2_m4_is_the_issue_s():
    """The order the issue quotes from a run of torch 2.13.0's ScheduleZBVZeroBubble."""
    assert " ".join(map(str, rank_order("zbv", 2, 0, 4)[:12])) == "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0"


def test_dualpipev_refuses_fewer_micro_batches_than_stages_as_torch_does():
    with pytest.raises(ValueError, match="DualPipeV requires at least as many microbatches as stages"):
        torch_orders("dualpipev", 2, 3)
    with pytest.raises(ParallelConfigError, match=r"needs at least 2 x pp = 4 micro-batches") as error:
        check_zero_bubble("dualpipev", 2, 3)
    assert "\n" not in str(error.value)

"""Collective sizes and groups at scale, traced by this process posing as a rank of a large job (torch's `fake`
process-group backend: no communication, as reference.measure.scale.simulate uses it): what the notes'
formulas predict for TP=8 inside a 64-rank world."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from reference.gpt.model import gpt_blocks
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.tensor_parallel.parallelize import parallelize


def step(layout, tp: int, sp: bool) -> list[dict]:
    """The collectives of one forward-backward of a TP = `tp` transformer, with or without SP."""
    model = parallelize(gpt_blocks(1, 8 * tp, tp), layout, sequence_parallel=sp)
    x = torch.randn(2 * tp, 3, 8 * tp)  # s = 2 tp, b = 3, h = 8 tp
    with CollectiveRecorder() as rec:
        rec.watch(model)
        model(None, None, hidden=x).sum().backward()
    return rec.to_dict()["events"]


@functools.cache
def trace(rank: int, world: int, tp: int) -> dict:
    """This rank's TP rank and both steps' collectives (tp, sp), recorded posing as `rank` of `world`."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        layout = build_layout(tp)
        return {"tp_rank": layout.tp_rank, "tp": step(layout, tp, sp=False), "sp": step(layout, tp, sp=True)}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_collective_bytes_and_groups_at_scale_with_fake_process_group(sp):
    tp, world, rank = 8, 64, 19
    result = trace(rank, world, tp)
    assert result["tp_rank"] == rank % tp
    events = result["sp" if sp else "tp"]
    n = (2 * tp) * 3 * (8 * tp) * 4  # s * b * h * fp32, independent of the TP size
    block = [e for e in events if e["module"].startswith("layers.0")]
    assert {tuple(e["group_ranks"]) for e in events} == {tuple(range(16, 24))}
    assert {e["nbytes"] for e in block} == {n}
    per_phase = {phase: sorted(e["op"] for e in block if e["phase"] == phase) for phase in ("forward", "backward")}
    if sp:
        assert per_phase == {
            "forward": ["all_gather"] * 2 + ["reduce_scatter"] * 2,
            "backward": ["all_gather"] * 4 + ["reduce_scatter"] * 2,
        }
    else:
        assert per_phase == {"forward": ["all_reduce"] * 2, "backward": ["all_reduce"] * 2}

"""reference.distributed.distributed on a process group the caller set up: used, and left to the caller (the
demo worker runs several demos on one group; a second default group under torchrun cannot connect)."""

import pytest
import torch
import torch.distributed as dist

from reference.distributed import distributed


def test_a_group_set_up_by_the_caller_is_used_and_left_in_place(one_rank_gloo):
    group = dist.group.WORLD
    with distributed("cpu") as device:
        assert device == torch.device("cpu") and dist.group.WORLD is group
    assert dist.is_initialized() and dist.group.WORLD is group


def test_a_failing_run_on_the_callers_group_leaves_it_in_place_too(one_rank_gloo):
    with pytest.raises(RuntimeError, match="failed on purpose"), distributed("cpu"):
        raise RuntimeError("failed on purpose")
    assert dist.is_initialized()
    dist.barrier()  # still usable

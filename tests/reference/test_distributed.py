"""reference.distributed.distributed on a process group the caller set up: used, and left to the caller (an
@on_ranks launch runs several demo tests on one group; a second default group under torchrun cannot connect)."""

import pytest
import torch
import torch.distributed as dist

from reference.distributed import LaunchError, distributed, pick_device, pick_dtype


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


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_ranks_get_a_gpu_each_or_auto_runs_on_cpu_and_cuda_is_refused_in_one_line(monkeypatch, gpus):
    """NCCL takes one rank per GPU: two local ranks on one GPU would share it and fail inside NCCL."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert pick_device("auto") == (torch.device("cuda", 1) if gpus == 2 else torch.device("cpu"))
    assert pick_device("cpu") == torch.device("cpu")
    if gpus == 2:
        assert pick_device("cuda") == torch.device("cuda", 1)
        return
    problem = "no CUDA device is visible" if gpus == 0 else r"with 2 ranks on this node needs 2 GPUs \(NCCL takes"
    with pytest.raises(LaunchError, match=problem):
        pick_device("cuda")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert pick_device("auto") == (torch.device("cuda", 0) if gpus else torch.device("cpu"))  # world 1: the GPU


@pytest.mark.parametrize("device, dtype", [("cuda", torch.bfloat16), ("cpu", torch.float32)])
def test_auto_dtype_is_bf16_on_cuda_as_megatron_trains_and_fp32_on_cpu(device, dtype):
    """A device is only a name here: no GPU is needed to resolve what a demo on one would train in."""
    assert pick_dtype("auto", torch.device(device)) == dtype
    assert pick_dtype("bf16", torch.device(device)) == torch.bfloat16
    assert pick_dtype("fp32", torch.device(device)) == torch.float32

"""The devices the reference tests run on: CPU/gloo always, CUDA/NCCL (marked `cuda`, skipped without GPUs)."""
import pytest

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)
DEVICES = ["cpu", CUDA]
# (world, device) of a worker checked at 2 and 4 CPU ranks and on 2 GPUs (NCCL)
WORLDS = [(2, "cpu"), (4, "cpu"), pytest.param((2, "cuda"), marks=pytest.mark.cuda)]


def world_id(world_device: tuple[int, str]) -> str:
    world, device = world_device
    return f"tp{world}" if device == "cpu" else f"{device}{world}"

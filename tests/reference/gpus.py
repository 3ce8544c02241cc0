"""The devices the reference tests run on: CPU/gloo always, CUDA/NCCL (marked `cuda`, skipped without GPUs)."""

import pytest

# A collective claim needs two ranks, so its CUDA form needs two GPUs (one per rank); run_worker skips it with
# fewer. Where one rank means something (TP vs unsharded at TP 1), the test adds a world-1 CUDA form.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# (world, device) of a worker checked at 2 and 4 CPU ranks and on 2 GPUs (NCCL)
WORLDS = [(2, "cpu"), (4, "cpu"), pytest.param((2, "cuda"), marks=pytest.mark.cuda)]


def world_id(world_device: tuple[int, str]) -> str:
    world, device = world_device
    return f"tp{world}" if device == "cpu" else f"{device}{world}"

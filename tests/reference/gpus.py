"""The CUDA/NCCL variants of the reference tests (one GPU per rank): skip without GPUs, launch with them."""
from pathlib import Path

import pytest

from tests.launch import torchrun

CUDA_ENV = {"REFERENCE_TEST_DEVICE": "cuda"}


def require_gpus(count: int) -> None:
    import torch

    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA device(s), found {torch.cuda.device_count()}")


# Module-fixture params for a worker checked at 2 and 4 CPU ranks and, with 2 GPUs, on CUDA.
WORLDS = [2, 4, pytest.param("cuda2", marks=pytest.mark.cuda)]


def world_id(world) -> str:
    return f"tp{world}" if isinstance(world, int) else world


def launch_world(world, worker: Path, *args: str, timeout: float = 180) -> tuple[int, str]:
    """Run `worker` (with `args`) at one of WORLDS; return (ranks, output)."""
    cuda = world == "cuda2"
    ranks = 2 if cuda else world
    if cuda:
        require_gpus(ranks)
    return ranks, torchrun(worker, ranks, *args, timeout=timeout, env=CUDA_ENV if cuda else None)

"""Skip helper for the CUDA/NCCL variants of the reference tests (one GPU per rank)."""
import pytest

CUDA_ENV = {"REFERENCE_TEST_DEVICE": "cuda"}


def require_gpus(count: int) -> None:
    import torch

    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA device(s), found {torch.cuda.device_count()}")

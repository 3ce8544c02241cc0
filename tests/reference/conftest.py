"""Fixtures of the in-process reference tests (the distributed ones run on ranks: tests/ranks.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_gloo():
    """A gloo process group of one rank in this process, for code that needs a group but no peers."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()

"""Fixtures of the in-process reference tests (the distributed ones run on ranks: tests/ranks.py), and the skip
of torch's upstream evidence on any torch but the pinned one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.launch import PINNED_TORCH, on_pinned_torch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that run torch's own FSDP1, DTensor or pipelining as the notes' evidence (upstream("pytorch")) skip
    on another torch: the notes cite the pinned torch's source, and another release may differ from it."""
    if on_pinned_torch():
        return
    skip = pytest.mark.skip(
        reason=f"upstream evidence of the cited torch {PINNED_TORCH} (constraints.txt); "
        f"torch {torch.__version__} is installed"
    )
    for item in items:
        if any(mark.args[:1] == ("pytorch",) for mark in item.iter_markers("upstream")):
            item.add_marker(skip)


@pytest.fixture
def one_rank_gloo():
    """A gloo process group of one rank in this process, for code that needs a group but no peers."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()

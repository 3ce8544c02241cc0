"""reference.torch_patches: each patch does what it says, undoes it, and refuses another torch in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work
from torch.distributed.fsdp import _runtime_utils
from torch.distributed.fsdp._limiter_utils import _FreeEventQueue

from reference import torch_patches
from reference.distributed import LaunchError
from tests.gitserver import free_port
from tests.launch import ROOT

OTHER = "2.14.0+cpu"


def test_written_for_the_installed_torch():
    assert torch.__version__.split("+")[0] == torch_patches.TORCH_VERSION
    torch_patches.require_pinned_torch()


@pytest.mark.parametrize(
    "apply",
    [
        lambda: torch_patches.work_wait_observed(print).__enter__(),
        lambda: torch_patches.fsdp1_runtime_wrapped(_unshard=print).__enter__(),
        lambda: torch_patches.fsdp1_rate_limiter_wrapped(print).__enter__(),
        torch_patches.cuda_calls_on_cpu,
    ],
    ids=["work_wait", "fsdp1_runtime", "fsdp1_rate_limiter", "cuda_calls_on_cpu"],
)
def test_every_patch_refuses_another_torch_in_one_line_and_patches_nothing(monkeypatch, apply):
    monkeypatch.setattr(torch, "__version__", OTHER)
    before = (
        Work.__dict__["wait"],
        _runtime_utils._unshard,
        _FreeEventQueue.dequeue_if_needed,
        torch.cuda.current_device,
        torch.cuda.synchronize,
    )
    with pytest.raises(torch_patches.TorchVersionError) as error:
        apply()
    message = str(error.value)
    assert "\n" not in message
    assert f"written for torch {torch_patches.TORCH_VERSION}, but torch {OTHER} is installed" in message
    assert isinstance(error.value, LaunchError)  # what the demos print as one line
    assert (
        Work.__dict__["wait"],
        _runtime_utils._unshard,
        _FreeEventQueue.dequeue_if_needed,
        torch.cuda.current_device,
        torch.cuda.synchronize,
    ) == before


def test_work_wait_observed_sees_every_wait_nested_and_restores_the_binding(one_rank_gloo):
    seen_outer, seen_inner = [], []
    descriptor = Work.__dict__["wait"]
    with torch_patches.work_wait_observed(seen_outer.append):
        with torch_patches.work_wait_observed(seen_inner.append):
            first = dist.all_reduce(torch.ones(3), async_op=True)
            first.wait()
        second = dist.all_reduce(torch.ones(3), async_op=True)
        second.wait()
    dist.all_reduce(torch.ones(3), async_op=True).wait()
    assert seen_outer == [first, second] and seen_inner == [first]
    assert Work.__dict__["wait"] is descriptor


def test_fsdp1_runtime_wrapped_routes_calls_through_around_and_restores():
    original = _runtime_utils._unshard
    calls = []

    def around(wrapped, *args):
        calls.append((wrapped, args))
        return "result"

    with torch_patches.fsdp1_runtime_wrapped(_unshard=around):
        assert _runtime_utils._unshard("state", "handle") == "result"
    assert calls == [(original, ("state", "handle"))]
    assert _runtime_utils._unshard is original
    with pytest.raises(torch_patches.TorchVersionError, match="has no _runtime_utils._renamed to wrap"):
        with torch_patches.fsdp1_runtime_wrapped(_unshard=around, _renamed=around):
            pass
    assert _runtime_utils._unshard is original


def test_fsdp1_rate_limiter_wrapped_sees_the_queue_and_restores():
    original = _FreeEventQueue.dequeue_if_needed
    queues = []
    with torch_patches.fsdp1_rate_limiter_wrapped(lambda wrapped, queue: queues.append(queue) or wrapped(queue)):
        queue = _FreeEventQueue()
        assert queue.dequeue_if_needed() is None  # nothing enqueued: no event to wait on
    assert queues == [queue] and _FreeEventQueue.dequeue_if_needed is original


def test_cuda_calls_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", torch.cuda.current_device)  # restored after the test
    monkeypatch.setattr(torch.cuda, "synchronize", torch.cuda.synchronize)
    torch_patches.cuda_calls_on_cpu()
    assert torch.cuda.current_device() == "cpu"
    assert torch.cuda.synchronize() is None
    assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"


@pytest.mark.parametrize("demo", [["--fsdp"], []], ids=["fsdp", "gpt"])
def test_a_demo_on_another_torch_fails_in_one_line(demo):
    """The demo's recorder applies a patch: a different torch is refused before any step, in one line."""
    code = (
        f"import torch; torch.__version__ = {OTHER!r}; from reference.__main__ import main; "
        f"main({[*demo, '--steps', '1', '--device', 'cpu']!r})"
    )
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert run.stderr.strip() == (
        f"reference: error: reference/torch_patches.py is written for torch "
        f"{torch_patches.TORCH_VERSION}, but torch {OTHER} is installed; install "
        f"torch=={torch_patches.TORCH_VERSION} (constraints.txt)"
    ), run.stderr

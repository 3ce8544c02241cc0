"""reference.measure.torch_patches: each patch does what it says and undoes it; each observer's probe checks the torch
internals it needs, not the version string, and a failed probe turns the observer off with one warning line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, Work
from torch.distributed.fsdp import _runtime_utils
from torch.distributed.fsdp._limiter_utils import _FreeEventQueue
from torch.utils import flop_counter

from reference.measure import torch_patches
from reference.measure.fsdp_tracing import torch_fsdp1_unit_scopes
from reference.measure.recorder import CollectiveRecorder
from tests.gitserver import free_port
from tests.launch import ROOT

OTHER = "2.99.0a0+nv27.01"  # a version no patch was written for: nothing may refuse it by its string

# The private torch APIs the collective recorder needs, and that a demo's training itself does not: each one
# missing turns the recorder off (Work.wait and c10d._resolve_process_group torch itself needs to train).
RECORDER_NEEDS = [
    (Work, "unbox"),
    (ProcessGroup, "unbox"),
    (torch._C, "_current_graph_task_id"),
    (torch._C, "_current_autograd_node"),
    (torch._C._autograd, "_get_sequence_nr"),
    (flop_counter, "flop_registry"),
]


@pytest.fixture
def probe_afresh():
    """available() probes once per process: forget its answers before and after the test."""
    torch_patches.available.cache_clear()
    yield
    torch_patches.available.cache_clear()


def test_probes_pass_on_the_installed_torch_whatever_its_version_string(monkeypatch, probe_afresh, capsys):
    monkeypatch.setattr(torch, "__version__", OTHER)
    assert torch_patches.available(torch_patches.RECORDER)
    assert torch_patches.available(torch_patches.FSDP1_SCOPES)
    assert CollectiveRecorder().on
    assert capsys.readouterr().err == ""
    assert not hasattr(torch_patches, "require_pinned_torch") and not hasattr(torch_patches, "TORCH_VERSION")


@pytest.mark.parametrize("owner, name", RECORDER_NEEDS, ids=[name for _, name in RECORDER_NEEDS])
def test_a_missing_api_turns_the_recorder_off_with_one_warning_line(monkeypatch, probe_afresh, capsys, owner, name):
    monkeypatch.delattr(owner, name)
    descriptor = Work.__dict__["wait"]
    first, second = CollectiveRecorder(), CollectiveRecorder()
    assert not first.on and not second.on
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "reference: warning: the collective recorder (reference.measure.recorder) is off: torch "
    ), err
    model = torch.nn.Linear(2, 2)
    assert first.watch(model) == []
    with first as rec:
        assert rec is first and CollectiveRecorder.active() == []
        assert Work.__dict__["wait"] is descriptor  # nothing patched
        model(torch.ones(1, 2)).sum().backward()
    assert first.events == [] and first.flops == 0 and model.weight.grad is not None


def test_an_api_that_behaves_otherwise_turns_the_recorder_off(monkeypatch, probe_afresh, capsys):
    """The probe checks behaviour too: a graph task id that never says "in backward" would mislabel every phase."""
    monkeypatch.setattr(torch._C, "_current_graph_task_id", lambda: -1)
    assert not CollectiveRecorder().on
    assert "numbers the autograd node running in backward otherwise" in capsys.readouterr().err


def test_fsdp1_scopes_turn_off_without_the_functions_they_wrap(monkeypatch, probe_afresh, capsys):
    monkeypatch.delattr(_runtime_utils, "_reduce_grad")
    unshard = _runtime_utils._unshard
    with torch_fsdp1_unit_scopes(torch.nn.Linear(2, 2)):
        assert _runtime_utils._unshard is unshard
    assert capsys.readouterr().err == (
        "reference: warning: FSDP1's unit scopes (reference.measure.fsdp_tracing) is off: torch "
        f"{torch.__version__} has no fsdp._runtime_utils._reduce_grad to wrap\n"
    )


@pytest.mark.parametrize(
    "apply, owner, name",
    [
        (lambda: torch_patches.work_wait_observed(print).__enter__(), Work, "wait"),
        (lambda: torch_patches.fsdp1_runtime_wrapped(_unshard=print).__enter__(), _runtime_utils, "_unshard"),
        (lambda: torch_patches.fsdp1_rate_limiter_wrapped(print).__enter__(), _FreeEventQueue, "dequeue_if_needed"),
    ],
    ids=["work_wait", "fsdp1_runtime", "fsdp1_rate_limiter"],
)
def test_a_patch_without_its_target_refuses_in_one_line_and_patches_nothing(monkeypatch, apply, owner, name):
    monkeypatch.delattr(owner, name)
    with pytest.raises(torch_patches.MissingTorchFeature) as error:
        apply()
    assert "\n" not in str(error.value) and f"torch {torch.__version__} has no " in str(error.value)
    assert name not in vars(owner)


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
    with pytest.raises(torch_patches.MissingTorchFeature, match="has no fsdp._runtime_utils._renamed to wrap"):
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
    monkeypatch.setattr(torch, "__version__", OTHER)  # no version gate
    torch_patches.cuda_calls_on_cpu()
    assert torch.cuda.current_device() == "cpu"
    assert torch.cuda.synchronize() is None
    assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"


@pytest.mark.parametrize("demo", [["--fsdp"], []], ids=["fsdp", "gpt"])
def test_a_demo_runs_on_a_torch_without_the_recorders_apis(demo):
    """Another version string, and none of the private APIs the recorder needs: the demo trains, says once that
    the recorder is off, and reports its steps without collectives."""
    removed = "; ".join(f"delattr({owner.__name__}, {name!r})" for owner, name in RECORDER_NEEDS)  # torch._C, Work
    code = (
        "import torch, torch.utils.flop_counter; from torch.distributed import ProcessGroup, Work; "
        f"torch.__version__ = {OTHER!r}; {removed}; "
        "from reference.__main__ import main; "
        f"main({[*demo, '--steps', '2', '--device', 'cpu']!r})"
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
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr == (
        "reference: warning: the collective recorder (reference.measure.recorder) is off: "
        f"torch {OTHER} has no Work.unbox\n"
    )
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2, run.stdout
    if demo == ["--fsdp"]:
        assert run.stdout.count("  total: none recorded\n") == 2, run.stdout
    else:
        assert all(line.endswith("collectives not recorded") for line in steps), run.stdout


def test_grouped_query_attention_flops_count_as_with_the_key_value_heads_repeated():
    """CUDA's attention kernels take Llama's fewer key/value heads; torch's formula before 2.13 asserts equal
    heads (the recorder failed so on an H200 with 2.11), so op_flops counts them as repeated, the kernel's work."""
    q, kv = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    forward = torch.ops.aten._scaled_dot_product_efficient_attention.default
    grouped = torch_patches.op_flops(forward, (q, kv, kv, None, False), {}, None)
    assert grouped == torch_patches.op_flops(forward, (q, q, q, None, False), {}, None) == 2 * 2 * (2 * 4 * 8 * 8 * 16)

"""Activation recomputation (reference.recompute): selective and full recomputation give the gradients of no
recomputation bit for bit, because the recomputed dropout masks are the same; an unknown mode is one line."""
import functools
import json
import subprocess
import sys

import pytest

from reference.parallel_state import ParallelConfigError
from reference.recompute import check_mode
from tests.launch import ROOT, torchrun
from tests.reference.activation_runs import activation_results

RUNS = [pytest.param(1, "cpu", id="t1-cpu"), pytest.param(2, "cpu", id="t2-cpu"),
        pytest.param(1, "cuda", id="t1-cuda", marks=pytest.mark.cuda)]


def _layouts(world: int, device: str) -> dict:
    """{layout: {mode: comparison}} of every rank, keyed by rank too."""
    return {f"rank{r}.{layout}": modes for r, result in enumerate(activation_results(world, device))
            for layout, modes in result["recompute"].items()}


@pytest.mark.parametrize("world, device", RUNS)
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_gives_the_losses_and_gradients_of_none_bit_for_bit(world, device, mode):
    layouts = _layouts(world, device)
    assert len(layouts) == world * (2 if world == 1 else 4)  # fp32 and bf16; at t 2 also with SP
    for layout, modes in layouts.items():
        assert modes[mode] == {"losses_equal": True, "grads_equal": True, "max_grad_diff": 0.0}, layout


@pytest.mark.parametrize("world, device", RUNS)
def test_without_restoring_the_tp_dropout_stream_the_recomputed_masks_differ(world, device):
    """The control: recomputing the attention core from wherever the per-TP-rank stream has moved on to draws
    other attention-dropout masks, so restoring that stream is what makes the gradients equal."""
    for layout, modes in _layouts(world, device).items():
        control = modes["selective_without_tp_stream_replay"]
        assert not control["grads_equal"] and control["max_grad_diff"] > 1e-3, layout


def test_an_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ParallelConfigError) as error:
        check_mode("partial")
    assert str(error.value) == "unknown recompute mode 'partial'; choose one of none, selective, full"


def test_the_demo_refuses_an_unknown_recompute_mode_in_one_line():
    out = subprocess.run([sys.executable, "-m", "reference", "--recompute", "partial"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "argument --recompute: invalid choice: 'partial'" in out.stderr


@functools.cache
def _demo_losses(recompute: str) -> list[float]:
    args = ["--json", "--steps", "2", "--dropout", "0.2", "--recompute", recompute, "--hidden-size", "16",
            "--seq-length", "8", "--vocab-size", "32", "--micro-batches", "2"]
    out = torchrun("-m", 1, "reference", *args, timeout=120)
    return [json.loads(line)["loss"] for line in out.splitlines() if line.startswith('{"step"')]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_the_demo_trains_the_same_with_recomputation(mode):
    """--recompute through the GPT stage and the pipeline step: the same losses as without, with dropout."""
    losses = _demo_losses(mode)
    assert len(losses) == 2 and losses == _demo_losses("none")

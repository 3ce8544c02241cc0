"""The pipeline demo's bubble: the recorded orders replayed with equal stages give (p - 1) / (v m + p - 1) on every
stage, and replayed in modeled time (each action's recorded FLOPs at a stated rate) within 0.03 of it when the
stages do nearly equal work; the wall-clock figure is printed beside them, labeled, with why it differs."""

import functools
import re

import pytest
from torch.utils import flop_counter

from reference.measure import torch_patches
from tests.ranks import on_ranks
from tests.reference.helpers import demo_output, json_lines

P, M = 4, 8
# a vocabulary of 8 against a hidden size of 32: the last stage's LM head adds ~2 % to its FLOPs, so the stages
# are nearly equal, as the formula assumes (test_replay.py covers unequal ones)
SMALL = ["--pp", str(P), "--micro-batches", str(M), "--steps", "1", "--batch-size", "1", "--seq-length", "8"]
SMALL += ["--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "8"]


@functools.cache
def demo(v: int, json: bool) -> str:
    """Rank 0's output of the 1F1B demo at pp 4, m 8 with v model chunks per stage (once a rank)."""
    return demo_output([*SMALL, "--num-layers", str(P * v), "--virtual-stages", str(v), *(["--json"] if json else [])])


@on_ranks(4)
@pytest.mark.parametrize("v", [1, 2])
def test_the_modeled_bubble_equals_the_formula_on_every_stage(ranks, v):
    (record,) = [line for line in json_lines(demo(v, json=True)) if "pipeline" in line]
    formula = (P - 1) / (v * M + P - 1)
    stages = record["pipeline"]
    assert [s["pp_rank"] for s in stages] == list(range(P))
    for stage in stages:
        assert stage["bubble_formula"] == pytest.approx(formula)
        assert stage["equal_stages_bubble"] == pytest.approx(formula)  # the recorded order is the textbook's
        assert abs(stage["modeled_bubble"] - formula) < 0.03, (stage["pp_rank"], stage["modeled_bubble"], formula)
        assert 0 <= stage["wall_clock_bubble"] < 1
    # the last stage also runs the LM head: the most work, so the least idle
    assert stages[-1]["modeled_bubble"] == min(s["modeled_bubble"] for s in stages)
    for stage in stages:  # in modeled time a stage computes its recorded FLOPs at the stated rate, then idles
        busy_s = sum(stage["action_flops"]) / (record["modeled_tflops"] * 1e12)
        assert busy_s / (1 - stage["modeled_bubble"]) == pytest.approx(record["modeled_step_s"])


@on_ranks(4)
def test_the_text_output_says_which_bubble_is_modeled_and_which_is_wall_clock(ranks):
    """Each stage's line shows the modeled bubble (deterministic: the same as the --json run's) and, labeled, this
    run's wall-clock one; the header says how each was obtained."""
    text = demo(1, json=False)
    (record,) = [line for line in json_lines(demo(1, json=True)) if "pipeline" in line]
    assert "with equal stages: the recorded orders replayed" in text and "formula (p-1)/(m+p-1) = 0.27" in text
    assert "at its FLOPs: the same replay, each action its recorded FLOPs at 100 TFLOP/s" in text, text
    assert re.search(r"wall clock: this run's, 4 ranks on \d+ CPU cores", text), text
    for stage in record["pipeline"]:
        line = rf"bubble 0.27 with equal stages, {stage['modeled_bubble']:.2f} at its FLOPs, wall clock 0\.\d\d$"
        assert re.search(line, text, re.MULTILINE), (line, text)


@on_ranks(2)
def test_without_recorded_flops_the_bubble_is_said_not_modeled(ranks):
    """On a torch whose FLOP formulas the recorder cannot reach, it is off (one warning line): no FLOPs, so the
    demo says the bubble is not modeled rather than dividing by a zero-length step."""
    registry = flop_counter.flop_registry
    del flop_counter.flop_registry
    torch_patches.available.cache_clear()  # probed once per process: forget its answers around the test
    try:
        out = demo_output(
            ["--pp", "2", "--steps", "1", "--micro-batches", "2", "--num-layers", "2", "--hidden-size", "16"]
        )
    finally:
        flop_counter.flop_registry = registry
        torch_patches.available.cache_clear()
    assert "at its FLOPs: not available, no FLOPs were recorded (the collective recorder is off)" in out, out
    assert re.search(
        r"expected 1\); bubble 0.33 with equal stages, not modeled at its FLOPs, wall clock 0\.\d\d$", out, re.M
    )

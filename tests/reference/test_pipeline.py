"""Pipeline parallelism: TP x PP x DP training equals the unsharded GPT, schedules run the textbook order
(and torch.distributed.pipelining's schedule IR), 1F1B holds fewer micro-batches than GPipe, failures end."""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, _ComputationType

from tests.launch import WORKERS, run_worker, torchrun_failing
from tests.reference.gpus import DEVICES


def torch_order(schedule: str, pp: int, stage: int, m: int) -> list[str]:
    """The compute actions torch.distributed.pipelining plans for this stage (idle slots and grad
    reductions dropped)."""
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    plan = cls(SimpleNamespace(num_stages=pp), m).pipeline_order[stage]
    names = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    return [
        f"{names[a.computation_type]}{a.microbatch_index}"
        for a in plan
        if a is not None and a.computation_type in names
    ]


def check(runs: list[dict], world: int) -> None:
    assert len({r["rank"] for r in runs}) == world
    for r in runs:
        assert r["max_loss_diff"] < 2e-6 and r["max_weight_diff"] < 2e-6, r
        pp, m, stage = r["layout"][1], r["m"], r["pp_rank"]
        if pp == 1 or m < pp:  # torch's Schedule1F1B refuses m < pp (Megatron runs it; the worker checks it)
            continue
        expected = torch_order(r["schedule"], pp, stage, m)
        if r["schedule"] == "1f1b" and stage == pp - 1:
            # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last stage's forwards from 1
            # (F1 .. Fm where F0 .. F(m-1) run); its runtime _step_microbatches runs F0 first, as we do.
            expected = [f"F{int(a[1:]) - 1}" if a[0] == "F" else a for a in expected]
        assert r["actions"] == expected, r
    for key in {(tuple(r["layout"]), r["sp"], r["m"], r["pp_rank"]) for r in runs}:
        (tp, pp, dp), sp, m, stage = key
        peak = {r["schedule"]: r["peak"] for r in runs if (tuple(r["layout"]), r["sp"], r["m"], r["pp_rank"]) == key}
        if pp > 1:
            assert peak == {"gpipe": m, "1f1b": min(pp - stage, m)}, (key, peak)
            if m > pp:
                assert peak["1f1b"] < peak["gpipe"], (key, peak)


@pytest.fixture(scope="module", params=DEVICES)
def world4(request):
    """Every run of the pipeline worker at world 4 (one launch per device for the tests below)."""
    runs = [
        run
        for result in run_worker("pipeline_worker.py", 4, device=request.param, timeout=240)
        for run in result["runs"]
    ]
    assert len(runs) == 4 * 5 * 2  # ranks x layouts x schedules
    return runs


def test_tp_pp_dp_training_equals_unsharded_for_both_schedules_world4(world4):
    check(world4, 4)


def test_1f1b_warmup_is_p_minus_r_minus_1_forwards_and_holds_p_minus_r_micro_batches(world4):
    """Megatron's num_warmup_microbatches = min(pp - rank - 1, m): stage r runs that many forwards before its
    first backward, so autograd keeps at most min(p - r, m) micro-batches alive there; GPipe keeps all m."""
    for r in world4:
        p, m, stage = r["layout"][1], r["m"], r["pp_rank"]
        if p == 1:
            continue
        leading = next((i for i, action in enumerate(r["actions"]) if action.startswith("B")), len(r["actions"]))
        if r["schedule"] == "1f1b":
            assert leading == min(p - stage - 1, m) + (1 if m > p - stage - 1 else 0), r
            assert r["peak"] == min(p - stage, m), r
        else:
            assert leading == m and r["peak"] == m, r


def test_dp_allreduces_start_only_in_the_last_backward_and_overlap_it(world4):
    """no_sync until the last micro-batch's backward (Megatron's enable_grad_sync before it): no DP
    all-reduce is issued during earlier backwards; several buckets' all-reduces start while it computes."""
    runs = [r for r in world4 if r["layout"][2] > 1]
    assert runs
    for r in runs:
        assert r["dp_allreduces"] > 1 and r["dp_allreduces_before_last_backward"] == 0, r
        assert r["dp_allreduces_during_last_backward"] >= 1, r


def test_rank_failing_mid_pipeline_ends_the_run_in_bounded_time():
    message, _ = torchrun_failing(WORKERS / "pipeline_crash_worker.py", 2)
    assert "simulated crash of stage 1" in message
    assert "unreachable on rank 0" not in message

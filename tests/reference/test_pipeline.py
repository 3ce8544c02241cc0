"""Pipeline parallelism at world 4: TP x PP x DP training equals the unsharded GPT for both schedules, the
schedules run the textbook order (and torch.distributed.pipelining's schedule IR), 1F1B holds fewer micro-batches
than GPipe, the DP all-reduces overlap the last backward, bad layouts are refused in one line, and a failing
stage ends the job.

Every rank trains each layout (`runs()`, once a rank) and asserts its losses, weights, orders and peaks there;
the claims compare every rank's runs (gathered).
"""

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, _ComputationType

from reference.gpt.model import GPTConfig, split_layers
from reference.gpt.parallelize import build_stage
from reference.gpt.train import data_parallel, split_batch, synthetic_batches, train_step
from reference.measure.pipeline_meter import PipelineMeter
from reference.measure.recorder import CollectiveRecorder
from reference.measure.replay import idle_fraction
from reference.parallel_state import ParallelConfigError, build_layout
from reference.pipeline.schedules import forward_backward
from tests.launch import CRASHES, torchrun_failing
from tests.pipeline_orders import textbook
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES
from tests.reference.helpers import (
    assert_close,
    every_rank,
    full_stage_parameters,
    groups_of_the_block,
    unsharded_gpt_training,
)

CONFIG = GPTConfig(vocab_size=51, hidden_size=16, num_attention_heads=4, num_layers=4, seq_length=8)
SEED, STEPS, LR = 1234, 3, 0.5
BUCKET_SIZE = 4096  # bytes: several DP buckets per stage, so their all-reduces overlap the last backward
# (tp, pp, dp, sequence_parallel, micro-batches) on 4 ranks, micro-batch size 1; world 8 (tp2 pp2 dp2) is
# covered by tests/reference/test_gpt_demo.py
LAYOUTS = [(1, 4, 1, False, 6), (1, 4, 1, False, 2), (2, 2, 1, True, 4), (1, 2, 2, False, 3), (2, 1, 2, False, 2)]


@groups_of_the_block()  # each layout's groups go with it
def run(device, tp, pp, dp, sp, m, schedule) -> dict:
    layout = build_layout(tp, pp, dp)
    what = f"tp{tp} pp{pp} dp{dp} sp={sp} m={m} {schedule}"
    stage = build_stage(CONFIG, layout, sequence_parallel=sp, seed=SEED, device=device)
    model = data_parallel(stage, layout, bucket_size=BUCKET_SIZE)  # several buckets: overlap in the 3D step
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    expected_losses, _, expected_weights = unsharded_gpt_training(CONFIG, SEED, STEPS, LR, dp * m)
    losses, results = [], []
    recorder = CollectiveRecorder()
    for tokens in synthetic_batches(CONFIG, STEPS, dp * m, SEED):
        recorder.clear()
        results.append(PipelineMeter(device))
        loss = train_step(
            model,
            optimizer,
            tokens,
            layout,
            num_micro_batches=m,
            schedule=schedule,
            device=device,
            record=recorder,
            observer=results[-1],
        )
        losses.append(loss)
    assert_close(torch.tensor(losses), torch.tensor(expected_losses), f"{what} losses", atol=2e-6, rtol=0)
    weight_diff = 0.0
    for name, full in full_stage_parameters(stage, layout.tp_group, CONFIG.vocab_size).items():
        expected = expected_weights[name]
        assert_close(full, expected, f"{what} final {name}", atol=2e-6, rtol=1e-5)
        weight_diff = max(weight_diff, (full - expected).abs().max().item())
    r = layout.pp_rank
    for result in results:
        assert result.actions == textbook(schedule, pp, r, m), (what, r, result.actions)
        peak = 1 if pp == 1 else (m if schedule == "gpipe" else min(pp - r, m))
        assert result.peak_in_flight == result.peak_in_flight_measured == peak, (what, r, result)
    last = results[-1]
    dp_ranks = tuple(dist.get_process_group_ranks(layout.dp_group))
    dp_starts = [e.start for e in recorder.events if e.op == "all_reduce" and e.group_ranks == dp_ranks]
    last_backward = last.action_spans[-1]
    assert last.actions[-1].startswith("B"), last.actions
    return {
        "layout": [tp, pp, dp],
        "sp": sp,
        "m": m,
        "schedule": schedule,
        "rank": dist.get_rank(),
        "pp_rank": r,
        "actions": last.actions,
        "peak": last.peak_in_flight_measured,
        "peak_activation_bytes": last.peak_activation_bytes,
        "wall_clock_bubble": last.wall_clock_bubble,
        "bubble_formula": last.bubble_formula,
        "dp_allreduces": len(dp_starts) if dp > 1 else 0,
        "dp_allreduces_before_last_backward": sum(t < last_backward[0] for t in dp_starts) if dp > 1 else 0,
        "dp_allreduces_during_last_backward": sum(last_backward[0] <= t < last_backward[1] for t in dp_starts)
        if dp > 1
        else 0,
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses, expected_losses)),
        "max_weight_diff": weight_diff,
    }


def bad_input() -> None:
    """Refused before any communication, with one-line errors."""
    cases = [
        (lambda: split_layers(2, 4), "4 pipeline stages need at least 4 transformer layers, the model has 2"),
        (
            lambda: split_batch(torch.zeros(10, 9, dtype=torch.long), 2, 0, 3),
            "a global batch of 10 sequences does not split into dp 2 x 3 micro-batches",
        ),
        (lambda: GPTConfig(hidden_size=10, num_attention_heads=4), "hidden_size (10) is not divisible"),
        (
            lambda: forward_backward("zero-bubble", None, [()], pp_group=None, activation_shape=()),
            "unknown pipeline schedule 'zero-bubble'",
        ),
        (lambda: forward_backward("1f1b", None, [], pp_group=None, activation_shape=()), "at least one micro-batch"),
    ]
    for fn, message in cases:
        try:
            fn()
        except ParallelConfigError as error:
            assert message in str(error) and "\n" not in str(error), (message, str(error))
        else:
            raise AssertionError(f"no error for: {message}")


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
        if pp == 1 or m < pp:  # torch's Schedule1F1B refuses m < pp (Megatron runs it; run() checks it)
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


@functools.cache
def runs(device: torch.device) -> list[dict]:
    """Every layout and schedule's run on this rank (each asserted against the unsharded model), after the
    bad-input checks; computed once a rank."""
    bad_input()
    return [run(device, tp, pp, dp, sp, m, schedule) for tp, pp, dp, sp, m in LAYOUTS for schedule in ("gpipe", "1f1b")]


def every_run(ranks) -> list[dict]:
    """Every rank's runs, gathered."""
    gathered = [run for rank in every_rank(runs(ranks.device)) for run in rank]
    assert len(gathered) == 4 * 5 * 2  # ranks x layouts x schedules
    return gathered


@on_ranks(4, devices=DEVICES)
def test_tp_pp_dp_training_equals_unsharded_for_both_schedules_world4(ranks):
    check(every_run(ranks), 4)


@on_ranks(4, devices=DEVICES)
def test_1f1b_warmup_is_p_minus_r_minus_1_forwards_and_holds_p_minus_r_micro_batches(ranks):
    """Megatron's num_warmup_microbatches = min(pp - rank - 1, m): stage r runs that many forwards before its
    first backward, so autograd keeps at most min(p - r, m) micro-batches alive there; GPipe keeps all m."""
    for r in every_run(ranks):
        p, m, stage = r["layout"][1], r["m"], r["pp_rank"]
        if p == 1:
            continue
        leading = next((i for i, action in enumerate(r["actions"]) if action.startswith("B")), len(r["actions"]))
        if r["schedule"] == "1f1b":
            assert leading == min(p - stage - 1, m) + (1 if m > p - stage - 1 else 0), r
            assert r["peak"] == min(p - stage, m), r
        else:
            assert leading == m and r["peak"] == m, r


@on_ranks(4, devices=DEVICES)
def test_dp_allreduces_start_only_in_the_last_backward_and_overlap_it(ranks):
    """no_sync until the last micro-batch's backward (Megatron's enable_grad_sync before it): no DP
    all-reduce is issued during earlier backwards; several buckets' all-reduces start while it computes."""
    data_parallel_runs = [r for r in every_run(ranks) if r["layout"][2] > 1]
    assert data_parallel_runs
    for r in data_parallel_runs:
        assert r["dp_allreduces"] > 1 and r["dp_allreduces_before_last_backward"] == 0, r
        assert r["dp_allreduces_during_last_backward"] >= 1, r


def test_rank_failing_mid_pipeline_ends_the_run_in_bounded_time():
    message, _ = torchrun_failing(CRASHES / "pipeline_crash.py", 2)
    assert "simulated crash of stage 1" in message
    assert "unreachable on rank 0" not in message


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("p, m", [(4, 8), (4, 6), (2, 4)])
def test_torch_gpipe_plan_idles_p_minus_1_over_m_plus_p_minus_1_as_1f1b_does(p, m):
    """GPipe's bubble is 1F1B's: torch's ScheduleGPipe plan (every forward, then every backward), replayed with
    uniform costs, idles (p - 1)/(m + p - 1), the fraction megatron's 1F1B order idles
    (test_megatron_pipeline_upstream.py); 1F1B reorders to hold fewer micro-batches, not to idle less."""
    orders = [torch_order("gpipe", p, stage, m) for stage in range(p)]
    assert all(order[:m] == [f"F{i}" for i in range(m)] for order in orders), orders
    assert idle_fraction(orders) == pytest.approx((p - 1) / (m + p - 1))

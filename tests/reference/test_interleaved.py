"""Interleaved 1F1B (reference.pipeline.interleaved) on CPU/gloo at world 4: it trains exactly like the unsharded
GPT, holds and idles what Narayanan et al. 2021 say it does, and torch.distributed.pipelining's
ScheduleInterleaved1F1B plans the same actions and computes the same losses and gradients. Megatron's own
interleaved schedule is compared in test_megatron_pipeline_upstream.py (same launch as its other claims)."""

from __future__ import annotations

import pytest

from reference import __main__ as demo_cli
from reference.measure.replay import idle_fraction
from tests.launch import run_worker
from tests.reference.demo_runs import demo_outputs, json_lines
from tests.reference.refusals import refusal


def ranks() -> list[dict]:
    """Every rank's results from one launch at world 4 (all layouts, the torch oracle)."""
    return run_worker("interleaved_worker.py", 4, timeout=420)


def runs() -> list[dict]:
    return [run for rank in ranks() for run in rank["runs"]]


def pipelines() -> dict[tuple, list[list[str]]]:
    """(tp, pp, dp, v, m) -> the action order of each pipeline rank (of one replica: DP ranks run the same)."""
    orders: dict[tuple, dict[int, list[str]]] = {}
    for run in runs():
        orders.setdefault((*run["layout"], run["v"], run["m"]), {})[run["pp_rank"]] = run["actions"]
    return {key: [by_rank[r] for r in sorted(by_rank)] for key, by_rank in orders.items()}


def test_interleaved_training_equals_the_unsharded_gpt_in_every_layout():
    """Two SGD steps with v chunks per stage (tp x pp x dp in 1x4x1, 1x2x2, 2x2x1 with SP; v 2 and 4):
    the losses and the final weights are the single-process model's, up to fp32 summation order."""
    assert {(*r["layout"], r["v"], r["m"]) for r in runs()} == {
        (1, 4, 1, 2, 4),
        (1, 4, 1, 2, 8),
        (1, 2, 2, 2, 4),
        (1, 2, 2, 4, 2),
        (2, 2, 1, 2, 4),
    }
    for run in runs():
        assert run["max_loss_diff"] < 2e-6 and run["max_weight_diff"] < 2e-6, run


def test_rank_r_warms_up_2_p_minus_r_minus_1_plus_v_minus_1_p_forwards_and_holds_one_more():
    """Megatron's warm-up, min(2 (p - r - 1) + (v - 1) p, v m) chunk-forwards, then one forward per backward:
    rank r holds at most one more than its warm-up, as the schedule counts and as autograd really keeps them."""
    for run in runs():
        p, r, v, m = run["layout"][1], run["pp_rank"], run["v"], run["m"]
        warmup = min(2 * (p - r - 1) + (v - 1) * p, v * m)
        leading = next((i for i, a in enumerate(run["actions"]) if a[0] == "B"), len(run["actions"]))
        assert leading == min(warmup + 1, v * m), run
        assert run["peak"] == run["peak_measured"] == min(warmup + 1, v * m), run


def test_the_first_rank_holds_more_activations_than_under_plain_1f1b():
    """The price of interleaving: at p 4, v 2, m 8 rank 0 keeps 11 chunk-forwards of L / 8 layers each, 5.5
    stages' worth, where plain 1F1B keeps p = 4 forwards of L / 4 layers."""
    first = next(r for r in runs() if (*r["layout"], r["v"], r["m"], r["pp_rank"]) == (1, 4, 1, 2, 8, 0))
    assert first["peak_measured"] == 11 and first["peak_measured"] / 2 > 4


def test_recorded_orders_idle_p_minus_1_over_v_m_of_the_ideal_time():
    """Replayed with uniform costs (a chunk's forward 1/v of a stage's, a backward twice a forward), each recorded
    step idles (p - 1) / (v m) of its ideal time: v times less than plain 1F1B's (p - 1) / m."""
    for (tp, p, dp, v, m), orders in pipelines().items():
        idle = idle_fraction(orders, chunks=v)
        assert idle / (1 - idle) == pytest.approx((p - 1) / (v * m)), (tp, p, dp, v, m)
        assert idle / (1 - idle) < (p - 1) / m


def test_each_chunk_reduces_its_dp_gradients_in_the_backward_of_its_last_micro_batch():
    """As megatron-core without grad_sync_func: every chunk under no_sync, lifted for the backward of the chunk's
    last micro-batch: all DP all-reduces are issued inside those backwards."""
    data_parallel = [r for r in runs() if r["layout"][2] > 1]
    assert data_parallel
    for run in data_parallel:
        assert run["dp_reduces"] > 0 and run["dp_reduces_outside_last_backwards"] == 0, run


@pytest.mark.upstream("pytorch")
def test_torch_interleaved_1f1b_plans_the_same_actions_on_every_rank():
    """ScheduleInterleaved1F1B (pp 4, two stages per rank, m 4 and 8): its pipeline_order for each rank, idle
    slots dropped, is the reference's recorded order."""
    for rank in ranks():
        for oracle in rank["torch"]:
            assert oracle["actions"] == oracle["torch_actions"], oracle


@pytest.mark.upstream("pytorch")
def test_torch_interleaved_1f1b_gives_the_same_losses_and_gradients():
    """The same chunks, initial weights and micro-batches through torch's schedule (PipelineStage on gloo) and the
    reference: equal micro-batch losses on the last rank and equal gradients everywhere (same fp32 operations)."""
    for rank in ranks():
        for oracle in rank["torch"]:
            assert oracle["losses"] == oracle["torch_losses"], oracle
            assert oracle["max_grad_diff"] == 0.0, oracle
    assert any(len(oracle["losses"]) == oracle["m"] for rank in ranks() for oracle in rank["torch"])


def refused(argv, capsys) -> str:
    err = refusal(demo_cli.main, argv, capsys)
    assert err.count("\n") == 1, err
    return err


def test_layers_that_p_times_v_does_not_divide_are_refused_in_one_line(capsys):
    assert (
        "6 transformer layers do not split into pp 4 x 2 virtual stages of equal size; use a multiple of 8"
        in refused(["--pp", "4", "--virtual-stages", "2", "--num-layers", "6", "--micro-batches", "4"], capsys)
    )


def test_micro_batches_not_a_multiple_of_p_are_refused_in_one_line(capsys):
    assert (
        "interleaved 1F1B (2 virtual stages) needs the number of micro-batches (6) to be a multiple of the "
        "pipeline size (4)"
        in refused(["--pp", "4", "--virtual-stages", "2", "--num-layers", "8", "--micro-batches", "6"], capsys)
    )


def test_virtual_stages_need_the_1f1b_schedule_and_replicated_dp(capsys):
    assert "--virtual-stages 2 needs --schedule 1f1b" in refused(
        ["--pp", "2", "--virtual-stages", "2", "--num-layers", "4", "--schedule", "gpipe"], capsys
    )


def test_schedule_refuses_a_single_stage_with_virtual_stages():
    from reference.parallel_state import ParallelConfigError
    from reference.pipeline.interleaved import check_interleaving

    with pytest.raises(ParallelConfigError, match="need a pipeline of at least 2 stages"):
        check_interleaving(1, 2, 4)


def test_the_demo_runs_interleaved_and_reports_every_chunks_parameters():
    """`-m reference --pp 2 --virtual-stages 2`: each rank's parameters are its two chunks' (once a crash: the
    memory report counted one model), and the ranks together hold the unsharded GPT's."""
    argv = ["--pp", "2", "--virtual-stages", "2", "--num-layers", "4", "--micro-batches", "2", "--steps", "1"]
    (out,) = demo_outputs(2, [*argv, "--hidden-size", "16", "--seq-length", "8", "--json"])
    lines = json_lines(out)
    step = next(x for x in lines if "step" in x)
    memory = next(x for x in lines if "memory" in x)["memory"]
    assert [m["param_bytes"] for m in memory][0] == step["param_bytes_per_rank"]
    assert sum(m["param_bytes"] for m in memory) == step["param_bytes_unsharded"]
    assert next(x for x in lines if "pipeline" in x)["pipeline"][0]["virtual_stages"] == 2

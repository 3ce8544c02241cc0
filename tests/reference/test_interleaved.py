"""Interleaved 1F1B (reference.pipeline.interleaved) on CPU/gloo at world 4: it trains exactly like the unsharded
GPT, holds and idles what Narayanan et al. 2021 say it does, and torch.distributed.pipelining's
ScheduleInterleaved1F1B plans the same actions and computes the same losses and gradients. Every rank trains each
layout (`layout_runs()`) and runs torch's schedule (`torch_oracles()`), once a rank; the tests compare every
rank's records. Megatron's own interleaved schedule is compared in test_megatron_pipeline_upstream.py."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from reference import __main__ as demo_cli
from reference.gpt.model import GPTConfig
from reference.gpt.parallelize import build_chunks
from reference.gpt.train import data_parallel, split_batch, synthetic_batches, train_step
from reference.measure.pipeline_meter import PipelineMeter
from reference.measure.recorder import CollectiveRecorder
from reference.measure.replay import idle_fraction
from reference.parallel_state import build_layout
from tests.ranks import on_ranks
from tests.reference.helpers import (
    demo_output,
    every_rank,
    full_stage_parameters,
    groups_of_the_block,
    json_lines,
    unsharded_gpt_training,
)
from tests.reference.refusals import refusal
from tests.reference.torch_pipelines import TorchChunk

CONFIG = GPTConfig(vocab_size=51, hidden_size=16, num_attention_heads=4, num_layers=8, seq_length=8)
SEED, STEPS, LR = 1234, 2, 0.5
# (tp, pp, dp, virtual stages, micro-batches), micro-batch size 1
LAYOUTS = [(1, 4, 1, 2, 4), (1, 4, 1, 2, 8), (1, 2, 2, 2, 4), (1, 2, 2, 4, 2), (2, 2, 1, 2, 4)]
TORCH_M = (4, 8)


@groups_of_the_block()  # each layout's groups go with it
def train_layout(tp: int, pp: int, dp: int, v: int, m: int) -> dict:
    layout = build_layout(tp, pp, dp)
    chunks = build_chunks(CONFIG, layout, v, sequence_parallel=tp > 1, seed=SEED)
    model = [data_parallel(chunk, layout, bucket_size=4096) for chunk in chunks]
    optimizer = torch.optim.SGD([p for chunk in model for p in chunk.parameters()], lr=LR)
    expected_losses, _, expected_weights = unsharded_gpt_training(CONFIG, SEED, STEPS, LR, dp * m)
    losses, recorder, result = [], CollectiveRecorder(), PipelineMeter()
    for tokens in synthetic_batches(CONFIG, STEPS, dp * m, SEED):
        recorder.clear()
        losses.append(
            train_step(model, optimizer, tokens, layout, num_micro_batches=m, record=recorder, observer=result)
        )
    weights = {
        name: tensor
        for chunk in chunks
        for name, tensor in full_stage_parameters(chunk, layout.tp_group, CONFIG.vocab_size).items()
    }
    dp_ranks = tuple(dist.get_process_group_ranks(layout.dp_group))
    reduces = [e.start for e in recorder.events if e.op == "all_reduce" and e.group_ranks == dp_ranks]
    last_backwards = {
        a.split(".")[0][1:]: span
        for a, span in zip(result.actions, result.action_spans)
        if a.startswith("B") and a.endswith(f".{m - 1}")
    }
    return {
        "layout": [tp, pp, dp],
        "v": v,
        "m": m,
        "pp_rank": layout.pp_rank,
        "actions": result.actions,
        "peak": result.peak_in_flight,
        "peak_measured": result.peak_in_flight_measured,
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses, expected_losses)),
        "max_weight_diff": max((weights[n] - expected_weights[n]).abs().max().item() for n in weights),
        "dp_reduces": len(reduces) if dp > 1 else 0,
        "dp_reduces_outside_last_backwards": sum(
            not any(s <= t < e for s, e in last_backwards.values()) for t in reduces
        )
        if dp > 1
        else 0,
    }


@groups_of_the_block()
def torch_oracle(m: int) -> dict:
    """torch's ScheduleInterleaved1F1B and the reference on the same chunks (pp 4, v 2), one step each."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import _ComputationType

    from reference.pipeline.schedules import forward_backward

    layout, v = build_layout(1, 4, 1), 2
    tokens = synthetic_batches(CONFIG, 1, m, SEED)[0]
    ours = build_chunks(CONFIG, layout, v, seed=SEED)
    result = PipelineMeter()
    our_losses = forward_backward(
        "1f1b",
        ours,
        split_batch(tokens, 1, 0, m),
        pp_group=layout.pp_group,
        activation_shape=ours[0].activation_shape(1),
        observer=result,
    )
    theirs = build_chunks(CONFIG, layout, v, seed=SEED)
    stages = [
        PipelineStage(TorchChunk(chunk), c * 4 + layout.pp_rank, 4 * v, torch.device("cpu"), group=layout.pp_group)
        for c, chunk in enumerate(theirs)
    ]
    schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=lambda loss, _target: loss.sum())
    losses = []
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    last = layout.pp_rank == 3
    kwargs = {"target": labels, "losses": losses} if last else {}
    if layout.pp_rank == 0:
        schedule.step(inputs, labels=labels, **kwargs)
    else:
        schedule.step(labels=labels, **kwargs)
    names = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    plan = [
        f"{names[a.computation_type]}{a.stage_index // 4}.{a.microbatch_index}"
        for a in schedule.pipeline_order[layout.pp_rank]
        if a is not None and a.computation_type in names
    ]
    grad_diff = max(
        (a.grad - b.grad).abs().max().item()
        for x, y in zip(ours, theirs)
        for a, b in zip(x.parameters(), y.parameters())
    )
    return {
        "m": m,
        "pp_rank": layout.pp_rank,
        "actions": result.actions,
        "torch_actions": plan,
        "losses": our_losses,
        "torch_losses": [loss.item() for loss in losses],
        "max_grad_diff": grad_diff,
    }


@functools.cache
def layout_runs() -> list[dict]:
    """Every layout's run on every rank (CPU only: see reference.pipeline.p2p.RingP2P), computed once a rank."""
    return [run for rank in every_rank([train_layout(*layout) for layout in LAYOUTS]) for run in rank]


@functools.cache
def torch_oracles() -> list[list[dict]]:
    """torch's schedule next to the reference's on the same chunks, for each m: every rank's list."""
    return every_rank([torch_oracle(m) for m in TORCH_M])


def pipelines() -> dict[tuple, list[list[str]]]:
    """(tp, pp, dp, v, m) -> the action order of each pipeline rank (of one replica: DP ranks run the same)."""
    orders: dict[tuple, dict[int, list[str]]] = {}
    for run in layout_runs():
        orders.setdefault((*run["layout"], run["v"], run["m"]), {})[run["pp_rank"]] = run["actions"]
    return {key: [by_rank[r] for r in sorted(by_rank)] for key, by_rank in orders.items()}


@on_ranks(4)
def test_interleaved_training_equals_the_unsharded_gpt_in_every_layout(ranks):
    """Two SGD steps with v chunks per stage (tp x pp x dp in 1x4x1, 1x2x2, 2x2x1 with SP; v 2 and 4):
    the losses and the final weights are the single-process model's, up to fp32 summation order."""
    assert {(*r["layout"], r["v"], r["m"]) for r in layout_runs()} == {
        (1, 4, 1, 2, 4),
        (1, 4, 1, 2, 8),
        (1, 2, 2, 2, 4),
        (1, 2, 2, 4, 2),
        (2, 2, 1, 2, 4),
    }
    for run in layout_runs():
        assert run["max_loss_diff"] < 2e-6 and run["max_weight_diff"] < 2e-6, run


@on_ranks(4)
def test_rank_r_warms_up_2_p_minus_r_minus_1_plus_v_minus_1_p_forwards_and_holds_one_more(ranks):
    """Megatron's warm-up, min(2 (p - r - 1) + (v - 1) p, v m) chunk-forwards, then one forward per backward:
    rank r holds at most one more than its warm-up, as the schedule counts and as autograd really keeps them."""
    for run in layout_runs():
        p, r, v, m = run["layout"][1], run["pp_rank"], run["v"], run["m"]
        warmup = min(2 * (p - r - 1) + (v - 1) * p, v * m)
        leading = next((i for i, a in enumerate(run["actions"]) if a[0] == "B"), len(run["actions"]))
        assert leading == min(warmup + 1, v * m), run
        assert run["peak"] == run["peak_measured"] == min(warmup + 1, v * m), run


@on_ranks(4)
def test_the_first_rank_holds_more_activations_than_under_plain_1f1b(ranks):
    """The price of interleaving: at p 4, v 2, m 8 rank 0 keeps 11 chunk-forwards of L / 8 layers each, 5.5
    stages' worth, where plain 1F1B keeps p = 4 forwards of L / 4 layers."""
    first = next(r for r in layout_runs() if (*r["layout"], r["v"], r["m"], r["pp_rank"]) == (1, 4, 1, 2, 8, 0))
    assert first["peak_measured"] == 11 and first["peak_measured"] / 2 > 4


@on_ranks(4)
def test_recorded_orders_idle_p_minus_1_over_v_m_of_the_ideal_time(ranks):
    """Replayed with uniform costs (a chunk's forward 1/v of a stage's, a backward twice a forward), each recorded
    step idles (p - 1) / (v m) of its ideal time: v times less than plain 1F1B's (p - 1) / m."""
    for (tp, p, dp, v, m), orders in pipelines().items():
        idle = idle_fraction(orders, chunks=v)
        assert idle / (1 - idle) == pytest.approx((p - 1) / (v * m)), (tp, p, dp, v, m)
        assert idle / (1 - idle) < (p - 1) / m


@on_ranks(4)
def test_each_chunk_reduces_its_dp_gradients_in_the_backward_of_its_last_micro_batch(ranks):
    """As megatron-core without grad_sync_func: every chunk under no_sync, lifted for the backward of the chunk's
    last micro-batch: all DP all-reduces are issued inside those backwards."""
    dp_runs = [r for r in layout_runs() if r["layout"][2] > 1]
    assert dp_runs
    for run in dp_runs:
        assert run["dp_reduces"] > 0 and run["dp_reduces_outside_last_backwards"] == 0, run


@on_ranks(4)
@pytest.mark.upstream("pytorch")
def test_torch_interleaved_1f1b_plans_the_same_actions_on_every_rank(ranks):
    """ScheduleInterleaved1F1B (pp 4, two stages per rank, m 4 and 8): its pipeline_order for each rank, idle
    slots dropped, is the reference's recorded order."""
    for rank in torch_oracles():
        for oracle in rank:
            assert oracle["actions"] == oracle["torch_actions"], oracle


@on_ranks(4)
@pytest.mark.upstream("pytorch")
def test_torch_interleaved_1f1b_gives_the_same_losses_and_gradients(ranks):
    """The same chunks, initial weights and micro-batches through torch's schedule (PipelineStage on gloo) and the
    reference: equal micro-batch losses on the last rank and equal gradients everywhere (same fp32 operations)."""
    for rank in torch_oracles():
        for oracle in rank:
            assert oracle["losses"] == oracle["torch_losses"], oracle
            assert oracle["max_grad_diff"] == 0.0, oracle
    assert any(len(oracle["losses"]) == oracle["m"] for rank in torch_oracles() for oracle in rank)


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


@on_ranks(2)
def test_the_demo_runs_interleaved_and_reports_every_chunks_parameters(ranks):
    """`-m reference --pp 2 --virtual-stages 2`: each rank's parameters are its two chunks' (once a crash: the
    memory report counted one model), and the ranks together hold the unsharded GPT's."""
    argv = ["--pp", "2", "--virtual-stages", "2", "--num-layers", "4", "--micro-batches", "2", "--steps", "1"]
    out = demo_output([*argv, "--hidden-size", "16", "--seq-length", "8", "--json"])
    lines = json_lines(out)
    step = next(x for x in lines if "step" in x)
    memory = next(x for x in lines if "memory" in x)["memory"]
    assert [m["param_bytes"] for m in memory][0] == step["param_bytes_per_rank"]
    assert sum(m["param_bytes"] for m in memory) == step["param_bytes_unsharded"]
    assert next(x for x in lines if "pipeline" in x)["pipeline"][0]["virtual_stages"] == 2

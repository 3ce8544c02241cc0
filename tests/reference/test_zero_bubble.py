"""The backward in two (I, then W) equals the one-pass backward exactly, and the zero-bubble schedules train
exactly as 1F1B does. Orders against torch's own schedules: tests/evidence/test_zero_bubble_orders_upstream.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from reference import __main__ as demo_cli
from reference.gpt.hf_weights import master_name
from reference.gpt.model import GPT, GPTConfig
from reference.gpt.parallelize import build_chunks, parallelize_gpt
from reference.gpt.train import data_parallel, split_batch, synthetic_batches, train_step
from reference.measure.pipeline_meter import PipelineMeter
from reference.measure.replay import idle_fraction
from reference.parallel_state import build_layout
from reference.pipeline.schedules import bubble_formula, forward_backward, peak_in_flight_formula
from reference.pipeline.steps import Steps
from reference.pipeline.zero_bubble import V_SCHEDULES, flat, rank_order, stages_of
from tests.ranks import on_ranks
from tests.reference.helpers import every_rank, groups_of_the_block
from tests.reference.refusals import refusal
from tests.reference.torch_pipelines import step_torch, torch_schedule

CONFIG = GPTConfig(vocab_size=51, hidden_size=16, num_attention_heads=4, num_layers=4, seq_length=8)
SEED = 1234


def _stage_grads(layers, sp: bool, split: bool, m: int = 3) -> tuple[dict, list, int]:
    """One TP-2 stage's parameter gradients and input gradients after m micro-batches, backward in one pass
    or as every I then every W (the order that holds the most); with the bytes the W's held at their peak."""
    layout = build_layout(2, 1, 1)
    stage = parallelize_gpt(GPT(CONFIG, SEED, layers=layers), layout.tp_group, sequence_parallel=sp, seed=SEED)
    tokens = synthetic_batches(CONFIG, 1, m, SEED)[0]
    micro_batches = split_batch(tokens, 1, 0, m)
    generator = torch.Generator().manual_seed(SEED)
    hiddens = [
        None if stage.is_first else torch.randn(stage.activation_shape(1), generator=generator).requires_grad_()
        for _ in range(m)
    ]
    steps = Steps([stage], micro_batches, is_last=stage.is_last)
    outputs = [steps.forward(i, hiddens[i]) for i in range(m)]
    grads = [None if stage.is_last else torch.randn(o.shape, generator=generator) for o in outputs]
    if not split:
        input_grads = [steps.backward(i, hiddens[i], outputs[i], grads[i]) for i in range(m)]
        return {n: p.grad.clone() for n, p in stage.named_parameters()}, input_grads, 0
    input_grads = [steps.backward_input(i, hiddens[i], outputs[i], grads[i]) for i in range(m)]
    held = steps.weight_grads.held_bytes
    linear_weights = [n for n, p in stage.named_parameters() if p.grad is None]
    assert linear_weights and all("norm" not in n for n in linear_weights), linear_weights  # W's share, not yet run
    for i in range(m):
        steps.backward_weight(i)
    assert steps.weight_grads.held_tensors == steps.weight_grads.held_bytes == 0
    return {n: p.grad.clone() for n, p in stage.named_parameters()}, input_grads, held


@on_ranks(2)
def test_backward_input_then_weight_equals_the_one_pass_backward_at_tp2(ranks):
    """Every parameter gradient and input gradient of a TP-2 GPT stage (with and without SP; the whole model,
    and a middle stage taking a hidden input) is bitwise the one-pass backward's, and W let go of all it held."""
    for layers in ((0, CONFIG.num_layers), (1, 3)):
        for sp in (False, True):
            with groups_of_the_block():
                one_pass, one_pass_inputs, _ = _stage_grads(layers, sp, split=False)
                split, split_inputs, held = _stage_grads(layers, sp, split=True)
            assert one_pass.keys() == split.keys()
            for name, grad in one_pass.items():
                assert torch.equal(grad, split[name]), (layers, sp, name, (grad - split[name]).abs().max())
            for a, b in zip(one_pass_inputs, split_inputs):
                assert (a is None and b is None) or torch.equal(a, b), (layers, sp)
            assert held > 0, (layers, sp)
    dist.barrier()


def step_names(schedule: str, p: int, r: int, m: int) -> list[str]:
    """Rank r's order as reference.pipeline.steps names what it runs: I<i>, or I<c>.<i> for its chunk c."""
    stages = stages_of(schedule, p, r)
    return [
        f"{a.kind}{stages.index(a.stage)}.{a.micro_batch}" if len(stages) > 1 else f"{a.kind}{a.micro_batch}"
        for a in flat(rank_order(schedule, p, r, m))
    ]


class _KeepGrads:
    """An optimizer whose step keeps the finalized gradients (train_step zeroes them after the step)."""

    def __init__(self, chunks):
        self.chunks, self.grads = chunks, {}

    def step(self):
        for chunk in self.chunks:
            stage = chunk.module
            self.grads.update({master_name(stage, n): p.grad.clone() for n, p in stage.named_parameters()})


def _train_one_step(schedule: str, m: int) -> dict:
    """One pp-2 step under `schedule` (DDP-wrapped chunks, as the demo trains): loss, every gradient, and the
    meter's record on this rank."""
    layout = build_layout(1, 2, 1)
    stages = build_chunks(CONFIG, layout, len(stages_of(schedule, 2, 0)), schedule=schedule, seed=SEED)
    chunks = [data_parallel(stage, layout, bucket_size=4096) for stage in stages]
    optimizer, meter = _KeepGrads(chunks), PipelineMeter()
    tokens = synthetic_batches(CONFIG, 1, m, SEED)[0]
    model = chunks if len(chunks) > 1 else chunks[0]
    loss = train_step(model, optimizer, tokens, layout, num_micro_batches=m, schedule=schedule, observer=meter)
    return {"loss": loss, "grads": optimizer.grads, "meter": meter.to_dict()}


@on_ranks(2)
def test_zero_bubble_schedules_give_1f1b_losses_and_gradients_at_pp2(ranks):
    """zb-h1, zbv and dualpipev at pp 2 train one step to 1F1B's loss and bitwise its every gradient (the V's
    stages gathered from both ranks), each rank running its order with the in-flight peak the formula says
    and holding its W's inputs until they run."""
    r = dist.get_rank()
    for m in (4, 5):
        with groups_of_the_block():
            expected = _train_one_step("1f1b", m)
        expected_grads = {k: g for rank in every_rank(expected["grads"]) for k, g in rank.items()}
        for schedule in ("zb-h1", "zbv", "dualpipev"):
            with groups_of_the_block():
                run = _train_one_step(schedule, m)
            assert run["loss"] == expected["loss"], (schedule, m, run["loss"], expected["loss"])
            grads = {k: g for rank in every_rank(run["grads"]) for k, g in rank.items()}
            assert grads.keys() == expected_grads.keys(), schedule
            for name, grad in grads.items():
                assert torch.equal(grad, expected_grads[name]), (schedule, m, name)
            meter = run["meter"]
            assert meter["actions"] == step_names(schedule, 2, r, m), (schedule, m, r, meter["actions"])
            peak = peak_in_flight_formula(schedule, 2, r, m)
            assert meter["peak_in_flight"] == meter["peak_in_flight_measured"] == peak, (schedule, m, r, meter)
            assert meter["peak_weight_grad_bytes"] > 0, (schedule, m, r)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev"])
def test_bubble_formula_is_the_replayed_order_with_f_i_w_equal(schedule):
    """Every rank's order replayed with F = I = W (transfers free) idles exactly the formula's fraction:
    ZB-H1 (p-1)/(3m+p-1), a third of 1F1B's bubble time; in a V (p-1)/(6m+p-1)."""
    for p in (2, 3, 4):
        for m in (2 * p, 2 * p + 1, 4 * p):
            orders = [step_names(schedule, p, r, m) for r in range(p)]
            chunks = len(stages_of(schedule, p, 0))
            replayed = idle_fraction(orders, chunks, v_shape=chunks == 2)
            assert replayed == pytest.approx(bubble_formula(p, m, chunks, schedule), abs=1e-12), (schedule, p, m)
            assert replayed < bubble_formula(p, m), (schedule, p, m)  # below 1F1B's


def test_peak_in_flight_closed_forms():
    """ZB-H1 holds 1F1B's min(p - r, m) forwards; ZB-V 2p chunk-forwards (half a stage each) on every rank once
    m >= 2p - 1; DualPipeV one more."""
    for p in (2, 3, 4, 5):
        for m in range(1, 4 * p):
            for r in range(p):
                assert peak_in_flight_formula("zb-h1", p, r, m) == min(p - r, m)
                if m >= 2 * p - 1:
                    assert peak_in_flight_formula("zbv", p, r, m) == 2 * p
                if m >= 2 * p:
                    assert peak_in_flight_formula("dualpipev", p, r, m) == 2 * p + 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pp", "2", "--schedule", "zbv", "--num-layers", "6"], "6 layers do not split; use a multiple of 4 layers"),
        (["--pp", "2", "--schedule", "dualpipev", "--num-layers", "4", "--micro-batches", "3"], "got 3"),
        (["--pp", "1", "--schedule", "zbv", "--num-layers", "4"], "it needs --pp >= 2, got 1"),
    ],
)
def test_zero_bubble_refusals_are_one_line(argv, message, capsys):
    err = refusal(demo_cli.main, argv, capsys)
    assert message in err and err.count("\n") == 1, err


def _torch_schedule(schedule: str, m: int) -> dict:
    """torch's ScheduleInterleavedZeroBubble (one stage per rank), ScheduleZBVZeroBubble or ScheduleDualPipeV
    and the reference on the same chunks (pp 2), one step each: this rank's losses and the largest gradient
    difference."""
    layout, p, r = build_layout(1, 2, 1), 2, dist.get_rank()
    tokens = synthetic_batches(CONFIG, 1, m, SEED)[0]
    stages = stages_of(schedule, p, r)
    ours = build_chunks(CONFIG, layout, len(stages), schedule=schedule, seed=SEED)
    our_losses = forward_backward(
        schedule,
        ours,
        split_batch(tokens, 1, 0, m),
        pp_group=layout.pp_group,
        activation_shape=ours[0].activation_shape(1),
    )
    theirs = build_chunks(CONFIG, layout, len(stages), schedule=schedule, seed=SEED)
    losses = step_torch(torch_schedule(schedule, theirs, stages, layout.pp_group, m), tokens, stages, p)
    grad_diff = max(
        (a.grad - b.grad).abs().max().item()
        for x, y in zip(ours, theirs)
        for a, b in zip(x.parameters(), y.parameters())
    )
    return {"losses": our_losses, "torch_losses": [loss.item() for loss in losses], "max_grad_diff": grad_diff}


@on_ranks(2)
@pytest.mark.upstream("pytorch")
def test_torch_zero_bubble_schedules_give_the_same_losses_and_gradients(ranks):
    """The same chunks, weights and micro-batches through torch's ScheduleInterleavedZeroBubble (one stage per
    rank), ScheduleZBVZeroBubble and ScheduleDualPipeV (PipelineStage on gloo, the backward split by its
    _backward.stage_backward_input/weight) and the reference: equal micro-batch losses on the rank holding the
    last stage (rank 1, or rank 0 in a V) and equal gradients on both ranks."""
    for schedule in ("zb-h1", "zbv", "dualpipev"):
        with groups_of_the_block():
            run = _torch_schedule(schedule, 4)
        loss_rank = 0 if schedule in V_SCHEDULES else 1
        assert run["losses"] == run["torch_losses"], (schedule, run)
        assert len(run["losses"]) == (4 if dist.get_rank() == loss_rank else 0), (schedule, run)
        assert run["max_grad_diff"] == 0.0, (schedule, run)

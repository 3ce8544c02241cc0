"""What the close reading of torch's zero-bubble and DualPipeV schedules claims, shown on torch's own code (torch
2.13.0), and where megatron-core 0.16.1 differs, shown on megatron's.

torch/distributed/pipelining/ on CPU: `stage_backward_input` and `stage_backward_weight` on a small module; the
orders of `ScheduleZBVZeroBubble` and `ScheduleDualPipeV`, built in one process that joins a world of p ranks
through torch's `fake` backend (every rank's order is computed on every rank; nothing is sent); and both schedules
stepped on a 2-rank gloo launch, four one-layer stages in a V, beside the same layers run in one process.
In the orders, "3I0" is stage 3's input gradient of micro-batch 0, "3W0" its weight gradient, "3B0" both in one
backward and "(0F3;3B1)OVERLAP_F_B" a forward paired with another micro-batch's backward. Megatron's layer-level
forward/backward interleaving runs on stand-in layers that record what megatron calls, in its order.
"""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleZBVZeroBubble
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import _Action, _ComputationType, _validate_schedule
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.ranks import on_ranks
from tests.reference.helpers import every_rank

pytestmark = pytest.mark.upstream("pytorch")

H, BATCH = 8, 2  # features, rows per micro-batch
ZBV_P2_M4 = [
    "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
    "_ 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3",
]
DUALPIPEV_P2_M4 = [
    "0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1)OVERLAP_F_B (3F2;0B0)OVERLAP_F_B 3B2 (3F3;0B1)OVERLAP_F_B 3B3 "
    "0I2 0W2 0I3 0W3",
    "1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0)OVERLAP_F_B (1F3;2B1)OVERLAP_F_B (2F3;1B1)OVERLAP_F_B 2B2 1B2 2I3 1I3 2W3 1W3",
]


def stage_module(seed: int) -> torch.nn.Module:
    """One stage: a linear layer and a tanh, its weights fixed by `seed`."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh())


@contextlib.contextmanager
def fake_world(p: int):
    """This process as rank 0 of a world of `p` (torch's fake backend: groups exist, nothing is sent)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)
    try:
        yield
    finally:
        dist.destroy_process_group()


def v_stages(p: int, group=None) -> list[PipelineStage]:
    """This rank's two stages of 2p in a V: r and 2p - 1 - r."""
    rank, n = dist.get_rank(group), 2 * p
    return [
        PipelineStage(stage_module(s), s, n, torch.device("cpu"), group=group) for s in sorted({rank, n - 1 - rank})
    ]


def orders(schedule_class, p: int, m: int) -> tuple[list[str], dict[int, list]]:
    """torch's per-rank compute orders (idle slots as "_") and its orders with the sends and receives added."""
    with fake_world(p):
        schedule = schedule_class(v_stages(p), m, loss_fn=torch.nn.functional.mse_loss)
        compute = [" ".join("_" if a is None else str(a) for a in schedule.pipeline_order[r]) for r in range(p)]
        return compute, schedule.pipeline_order_with_comms


def opening(order: str, p: int) -> tuple[dict[str, int], str]:
    """One rank's first 2p actions, counted as forwards of its outgoing chunk (stage r) and of its returning one
    (stage 2p - 1 - r), and the action after them."""
    steps = [a for a in order.split() if a != "_"]
    outgoing = min(int(a.split("F")[0]) for a in steps if "F" in a and "(" not in a)
    counts = {"outgoing F": 0, "returning F": 0, "other": 0}
    for action in steps[: 2 * p]:
        if "F" not in action or "(" in action:
            counts["other"] += 1
        else:
            counts["outgoing F" if int(action.split("F")[0]) == outgoing else "returning F"] += 1
    return counts, steps[2 * p]


def test_stage_backward_input_keeps_the_weight_paths_for_stage_backward_weight():
    """stage_backward_input computes the input gradient alone (no weight .grad), keeps the graph
    (retain_graph=True), and hooks the node where each linear's weight and bias join the input path to hold the
    gradient arriving there; it detaches the stage output. stage_backward_weight, later, runs autograd from those
    held gradients to the weights: together exactly one full backward."""
    one, split = stage_module(0), stage_module(0)
    x, grad = torch.randn(3, H), torch.randn(3, H)
    x_one = x.clone().requires_grad_()
    one(x_one).backward(grad)

    x_split = x.clone().requires_grad_()
    out = split(x_split)
    dinputs, param_groups = stage_backward_input([out], [grad], [x_split], split.parameters())
    assert torch.equal(dinputs[0], x_one.grad)
    assert all(w.grad is None for w in split.parameters())
    assert out.grad_fn is None  # detached: the output side of the graph is released
    assert [len(g["params"]) for g in param_groups] == [2]  # the linear's weight and bias, one group
    assert [type(n).__name__ for g in param_groups for n in g["intermediates"]] == ["AddmmBackward0"]
    assert all(t is not None for g in param_groups for held in g["grads"] for t in held)

    stage_backward_weight(split.parameters(), param_groups)
    for a, b in zip(one.parameters(), split.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_weight_gradients_wait_for_their_own_input_gradient_only():
    """In the lowered ZBV order no send or receive is added for a W: only F (activations out) and I (input
    gradients back; ZBV has no full B) communicate. A W may not precede its own I: torch's validator refuses
    the order."""
    _, with_comms = orders(ScheduleZBVZeroBubble, 2, 4)
    sends = (_ComputationType.SEND_F, _ComputationType.SEND_B)
    for rank_order in with_comms.values():
        assert any(a.computation_type == _ComputationType.BACKWARD_WEIGHT for a in rank_order)
        for before, after in zip(rank_order, rank_order[1:], strict=False):
            if after.computation_type in sends:
                assert before.computation_type in (_ComputationType.FORWARD, _ComputationType.BACKWARD_INPUT)

    compute, _ = orders(ScheduleZBVZeroBubble, 2, 4)
    rank1 = [_Action.from_str(a) for a in compute[1].split() if a != "_"]
    i0, w0 = rank1.index(_Action.from_str("2I0")), rank1.index(_Action.from_str("2W0"))
    rank1[i0], rank1[w0] = rank1[w0], rank1[i0]
    rank0 = [_Action.from_str(a) for a in compute[0].split()]
    with pytest.raises(AssertionError, match="Running Backward Weight for stage 2, microbatch 0 without first"):
        _validate_schedule({0: rank0, 1: rank1}, 2, 4, 4)


@pytest.mark.parametrize("p", [2, 4])
def test_zbv_gives_rank_r_stages_r_and_2p_minus_1_minus_r(p):
    """The V: both schedules take exactly two stages per rank; rank r holds stage r on the way out and
    2p - 1 - r on the way back, so rank 0 holds the first stage and the last (the loss), and rank p - 1 holds
    p - 1 and p: that hand-off, forward and backward, gets no send or receive."""
    for schedule_class in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
        with fake_world(p), pytest.raises(ValueError, match="requires exactly 2 stages per rank, but got 1"):
            schedule_class(v_stages(p)[:1], 2 * p, loss_fn=torch.nn.functional.mse_loss)
    assert generate_stage_to_rank_mapping(p, 2 * p, style="v") == {s: min(s, 2 * p - 1 - s) for s in range(2 * p)}
    _, with_comms = orders(ScheduleZBVZeroBubble, p, 2 * p)
    sent = {(a.computation_type.value, a.stage_index) for order in with_comms.values() for a in order}
    assert ("SEND_F", p - 2) in sent and ("SEND_F", p - 1) not in sent and ("RECV_F", p) not in sent
    assert ("SEND_B", p) not in sent and ("RECV_B", p - 1) not in sent
    assert ("SEND_F", p) in sent and ("SEND_B", p + 1) in sent


def test_zbv_and_dualpipev_orders_at_p_2_m_4():
    """torch's orders at p 2, m 4, rank by rank, idle slots kept."""
    assert orders(ScheduleZBVZeroBubble, 2, 4)[0] == ZBV_P2_M4
    assert orders(ScheduleDualPipeV, 2, 4)[0] == DUALPIPEV_P2_M4


@pytest.mark.parametrize("p", [2, 4])
def test_zbv_pairs_each_w_with_its_i_until_the_cool_down_runs_is_ahead(p):
    """ZBV runs each W just after its own I up to the last forward's I and W. Then the cool-down: rank r runs r
    pairs of input gradients alone, its outgoing chunk's (stage r) then its returning chunk's (stage 2p - 1 - r),
    then p - r of the outgoing chunk's, each followed by the W of the micro-batch r before it; the drain runs the
    Ws left, the returning chunk's first, and every W still comes after its own I."""
    forward, i, w = _ComputationType.FORWARD, _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT
    compute, _ = orders(ScheduleZBVZeroBubble, p, 2 * p)
    for r, order in enumerate(compute):
        actions = [_Action.from_str(a) for a in order.split() if a != "_"]
        outgoing, returning = r, 2 * p - 1 - r
        cool_down = max(n for n, a in enumerate(actions) if a.computation_type == forward) + 3
        steady, alone = actions[:cool_down], actions[cool_down : cool_down + 2 * r]
        with_older = actions[cool_down + 2 * r : cool_down + 2 * p]
        drain = actions[cool_down + 2 * p :]
        for n, a in enumerate(steady):
            if a.computation_type == i:
                assert steady[n + 1] == _Action(a.stage_index, w, a.microbatch_index), (r, order)
        assert [(a.stage_index, a.computation_type) for a in alone] == [(outgoing, i), (returning, i)] * r
        pairs = list(zip(with_older[::2], with_older[1::2], strict=True))
        assert len(pairs) == p - r
        for input_grad, weight_grad in pairs:
            assert (input_grad.stage_index, input_grad.computation_type) == (outgoing, i)
            assert (weight_grad.stage_index, weight_grad.computation_type) == (outgoing, w)
            assert weight_grad.microbatch_index == input_grad.microbatch_index - r
        assert [(a.stage_index, a.computation_type) for a in drain] == [(returning, w)] * r + [(outgoing, w)] * r
        for n, a in enumerate(actions):
            if a.computation_type == w:
                assert _Action(a.stage_index, i, a.microbatch_index) in actions[:n]


@pytest.mark.parametrize("schedule_class", [ScheduleZBVZeroBubble, ScheduleDualPipeV])
@pytest.mark.parametrize("p", [2, 4])
def test_every_rank_opens_with_2p_chunk_forwards(schedule_class, p):
    """Both schedules open rank r with 2p - r - 1 forwards of its outgoing chunk and r + 1 of its returning one,
    2p chunk-forwards (p stages' worth) on every rank, where torch's 1F1B runs p - r stage forwards before its
    first backward; then the returning chunk's input gradient, except on DualPipeV's last rank, where one more
    outgoing forward comes first."""
    with fake_world(p):
        one_f_one_b = Schedule1F1B(PipelineStage(stage_module(0), 0, p, torch.device("cpu")), 4 * p)
        for r in range(p):
            order = [a for a in one_f_one_b.pipeline_order[r] if a is not None]
            first_backward = next(i for i, a in enumerate(order) if a.computation_type != _ComputationType.FORWARD)
            assert first_backward == p - r
    compute, _ = orders(schedule_class, p, 4 * p)
    for r, order in enumerate(compute):
        counts, after = opening(order, p)
        assert counts == {"outgoing F": 2 * p - r - 1, "returning F": r + 1, "other": 0}, (r, order)
        last_dualpipe = schedule_class is ScheduleDualPipeV and r == p - 1
        assert after == (f"{r}F{2 * p - r - 1}" if last_dualpipe else f"{2 * p - 1 - r}I0"), (r, order)


def test_zbv_pads_few_micro_batches_with_idle_slots_and_dualpipev_refuses_them():
    """ZBV plans max(2p - 1, m) micro-batches and blanks the extra ones' actions; DualPipeV refuses m < 2p."""
    compute, _ = orders(ScheduleZBVZeroBubble, 2, 2)
    assert compute[0] == "0F0 0F1 _ 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 _ _ _ 0I1 0W1 _ _"
    with pytest.raises(ValueError, match="DualPipeV requires at least as many microbatches as stages, but got 3"):
        orders(ScheduleDualPipeV, 2, 3)


def test_dualpipev_pairs_a_forward_with_another_chunks_full_backward():
    """Each OVERLAP_F_B pairs one chunk's forward with the other chunk's full backward (B, not I then W) of an
    earlier micro-batch; the last rank's first pair of the main phase is left unpaired."""
    compute, _ = orders(ScheduleDualPipeV, 4, 8)
    for r, order in enumerate(compute):
        pairs = [a for a in order.split() if "OVERLAP_F_B" in a]
        assert pairs
        for pair in pairs:
            forward, backward = pair[1:].split(")")[0].split(";")
            assert "F" in forward and "B" in backward
            assert forward.split("F")[0] != backward.split("B")[0]  # the other chunk
            assert {forward.split("F")[0], backward.split("B")[0]} == {str(r), str(7 - r)}
            assert int(backward.split("B")[1]) < int(forward.split("F")[1])  # an earlier micro-batch
    assert "3F4 4B0" in compute[3]


# ---- stepped on 2 ranks (gloo) ----


def step_with_torch(schedule_class, m: int) -> dict:
    """One step of `schedule_class` on four one-layer stages in a V (p 2, m micro-batches), recording each
    stage's forwards, backwards and backward kinds in the order they ran; and the same layers, run in one
    process with one full backward per micro-batch, for the losses and gradients."""
    from torch.distributed.pipelining import stage as stage_module_of_torch

    p, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1)
    x, target = torch.randn(m * BATCH, H), torch.randn(m * BATCH, H)
    stages = v_stages(p)
    schedule = schedule_class(stages, m, loss_fn=torch.nn.functional.mse_loss)
    calls: list[tuple] = []
    base = stage_module_of_torch.PipelineStage
    real = {name: getattr(base, name) for name in ("forward_one_chunk", "backward_one_chunk")}
    real_kind = stage_module_of_torch._PipelineStageBase.backward_maybe_with_nosync

    def recording(name):
        def run(self, chunk, *args, **kwargs):
            calls.append((name, self.stage_index, chunk))
            return real[name](self, chunk, *args, **kwargs)

        return run

    def kind(self, backward_type, *args, **kwargs):
        calls.append(("kind", self.stage_index, backward_type))
        return real_kind(self, backward_type, *args, **kwargs)

    losses: list[torch.Tensor] = []
    with (
        mock.patch.object(base, "forward_one_chunk", recording("forward_one_chunk")),
        mock.patch.object(base, "backward_one_chunk", recording("backward_one_chunk")),
        mock.patch.object(stage_module_of_torch._PipelineStageBase, "backward_maybe_with_nosync", kind),
    ):
        if rank == 0:
            schedule.step(x, target=target, losses=losses)  # rank 0 holds stage 0 and the last stage
        else:
            schedule.step()

    whole = [stage_module(s) for s in range(2 * p)]
    expected_losses = []
    for xs, ts in zip(x.chunk(m), target.chunk(m), strict=True):
        h = xs
        for layer in whole:
            h = layer(h)
        loss = torch.nn.functional.mse_loss(h, ts)
        expected_losses.append(loss.item())
        (loss / m).backward()  # torch's scale_grads=True divides by m
    grad_diff = max(
        (a.grad - b.grad).abs().max().item()
        for stage in stages
        for a, b in zip(stage.submod.parameters(), whole[stage.stage_index].parameters(), strict=True)
    )
    return {
        "rank": rank,
        "calls": calls,
        "losses": [loss.item() for loss in losses],
        "expected_losses": expected_losses if rank == 0 else [],
        "max_grad_diff": grad_diff,
        "custom_functions": len(schedule._comp_type_to_function_map),
    }


@functools.cache
def stepped() -> dict[str, list[dict]]:
    """Both schedules stepped once on every rank, computed once a rank."""
    return {
        "zbv": every_rank(step_with_torch(ScheduleZBVZeroBubble, 4)),
        "dualpipev": every_rank(step_with_torch(ScheduleDualPipeV, 4)),
    }


@on_ranks(2)
def test_zbv_and_dualpipev_step_to_the_losses_and_gradients_of_one_full_backward(ranks):
    """Stepped on gloo, both schedules give the one-process losses and the one-full-backward gradients; the
    first stage's I computes nothing and its W runs the full backward (stage 0's input needs no gradient), every
    other I runs the input backward and its W the weight backward."""
    for name, runs in stepped().items():
        for run in runs:
            assert run["max_grad_diff"] < 1e-6, (name, run)
        torch.testing.assert_close(runs[0]["losses"], runs[0]["expected_losses"], rtol=0, atol=1e-6)
        kinds = [(s, k) for run in runs for what, s, k in run["calls"] if what == "kind"]
        if name == "zbv":
            assert {k for s, k in kinds if s == 0} == {"full"}
            assert all({k for s, k in kinds if s == stage} == {"input", "weight"} for stage in (1, 2, 3))


@on_ranks(2)
def test_dualpipev_runs_each_pair_forward_first_then_backward(ranks):
    """With no function registered for OVERLAP_F_B, torch runs a pair's forward to its end, then the other
    micro-batch's backward: the pairing is a plan for overlap, not overlap."""
    for run in stepped()["dualpipev"]:
        assert run["custom_functions"] == 0
        chunks = [(what, s, mb) for what, s, mb in run["calls"] if what != "kind"]
        if run["rank"] == 0:
            pair = chunks.index(("forward_one_chunk", 0, 3))
            assert chunks[pair + 1] == ("backward_one_chunk", 3, 1)  # (0F3;3B1)
        else:
            pair = chunks.index(("forward_one_chunk", 2, 2))
            assert chunks[pair + 1] == ("backward_one_chunk", 1, 0)  # (2F2;1B0)


# ---- megatron-core ----


@pytest.mark.upstream("megatron-lm")
def test_megatron_delay_wgrad_compute_needs_the_expert_all_to_all_overlap():
    """megatron defers weight gradients only inside its EP all-to-all overlap: delay_wgrad_compute alone is
    refused, and the overlap needs expert parallelism and, with pipelining, virtual stages."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=H, num_attention_heads=1, bf16=True)
    with pytest.raises(AssertionError, match="overlap_moe_expert_parallel_comm must be enabled when enabling"):
        TransformerConfig(**base, delay_wgrad_compute=True)
    with pytest.raises(AssertionError, match="only supported with expert model parallelism"):
        TransformerConfig(**base, overlap_moe_expert_parallel_comm=True)
    with pytest.raises(AssertionError, match="virtual_pipeline_model_parallel_size must be specified"):
        TransformerConfig(
            **base, overlap_moe_expert_parallel_comm=True, pipeline_model_parallel_size=2, pipeline_dtype=torch.bfloat16
        )


def stand_in_layer(tag: str, ran: list[str]):
    """A stand-in for megatron's TransformerLayerSchedulePlan: each step of each node (attention, dispatch, MLP,
    combine, MTP) appends "tag.node.step" to `ran` when megatron's layer plan calls it."""
    parts = {}
    for part in ("attn", "moe_dispatch", "mlp", "moe_combine", "mtp_post_process"):
        node = mock.Mock()
        for what in ("forward", "backward", "backward_dw"):
            getattr(node, what).side_effect = lambda x=None, _n=f"{tag}.{part}.{what}": ran.append(_n) or x
        parts[part] = node
    config = mock.Mock(ep_overlap_early_attn_memory_release=False)
    return mock.Mock(**parts, config=config, get_fp8_context=contextlib.nullcontext)


@pytest.mark.upstream("megatron-lm")
def test_megatron_interleaves_one_layers_forward_with_another_micro_batchs_backward():
    """megatron's combined 1F1B works inside a layer: the backward micro-batch's MLP weight gradient runs right
    after its MLP input gradient, while the forward micro-batch's dispatch all-to-all is in flight, and its
    attention weight gradient after its attention backward."""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerLayerSchedulePlan

    ran: list[str] = []
    layer = functools.partial(stand_in_layer, ran=ran)
    TransformerLayerSchedulePlan.run(layer("f"), layer("b"), f_input=0, b_grad=0)
    assert ran == [
        "b.mtp_post_process.backward",
        "b.moe_combine.backward",
        "f.attn.forward",
        "b.mlp.backward",
        "f.moe_dispatch.forward",
        "b.mlp.backward_dw",
        "b.moe_dispatch.backward",
        "f.mlp.forward",
        "f.moe_combine.forward",
        "f.mtp_post_process.forward",
        "b.attn.backward",
        "b.attn.backward_dw",
    ]


@pytest.mark.upstream("megatron-lm")
def test_megatron_runs_an_unpaired_backward_layers_mlp_weight_gradient_with_no_dispatch_to_hide_it():
    """A model chunk's combined step pairs as many layers as the shorter side has: here a forward of one layer
    with a backward of two. The pair runs as in the test above; the backward's other layer runs alone, its MLP
    weight gradient right after its MLP input gradient with no forward dispatch in flight. Attention's weight
    gradient waits to its layer's end, and for the chunk's first layer (the last in backward) until after the
    step's pipeline send (post_backward)."""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan

    ran: list[str] = []

    class Plan:  # a stand-in TransformerModelChunkSchedulePlan: its layers, popped last first in backward
        def __init__(self, *tags: str):
            self.layers = [stand_in_layer(tag, ran) for tag in tags]
            self.pre_process, self.post_process, self.vp_stage = mock.Mock(), None, 0
            self.record_current_stream = self.wait_current_stream = self.release_state = lambda: None

        def num_layers(self) -> int:
            return len(self.layers)

        def get_layer(self, i: int):
            return self.layers[i]

        def pop_layer(self):
            return self.layers.pop()

    with mock.patch("torch.cuda.nvtx.range_push"), mock.patch("torch.cuda.nvtx.range_pop"):
        TransformerModelChunkSchedulePlan.run(
            Plan("f0"), Plan("b0", "b1"), b_grad=0, post_backward=lambda grad, vp_stage: ran.append("post_backward")
        )
    paired = [n for n in ran if n.startswith(("f0.", "b1."))]
    assert paired.index("b1.mlp.backward_dw") == paired.index("f0.moe_dispatch.forward") + 1
    assert [n for n in ran if n.startswith("b0.") or n == "post_backward"] == [
        "b0.mtp_post_process.backward",
        "b0.moe_combine.backward",
        "b0.mlp.backward",
        "b0.mlp.backward_dw",
        "b0.moe_dispatch.backward",
        "b0.attn.backward",
        "post_backward",
        "b0.attn.backward_dw",
    ]
    assert ran.index("b1.attn.backward_dw") == ran.index("b1.attn.backward") + 1

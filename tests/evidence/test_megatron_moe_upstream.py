"""The MoE note's claims, shown on megatron-core 0.16.1's own MoELayer (CPU/gloo, 2 ranks, expert-parallel size 2).

The first test to ask runs (`records()`, once a rank, gathered so each rank sees both) megatron's MoELayer built
as its GPT spec builds it on CPU (`get_mlp_module_spec(use_te=False, ...)`: TopKRouter, SequentialMLP experts) in
five configurations: TransformerConfig's defaults (allgather dispatcher, dropless, no load-balancing loss),
a load-balancing loss, the alltoall dispatcher, a capacity factor, and a capacity factor padded to capacity.
Each case keeps what megatron did: the router's map and probabilities, every permute() call, what each expert
was handed, the collectives with their bytes (CollectiveRecorder), the dispatcher's split sizes, outputs and
gradients. Defaults are megatron-core's except `use_cpu_initialization=True`, the sizes below, and what a case
changes; the GPU-only steps megatron needs stand-ins for are in tests/reference/megatron_moe_on_cpu.py.
The expert-parallel groups are megatron's initialize_model_parallel at world 8 (fake backend, one process).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
from megatron.core.transformer.moe import moe_utils, token_dispatcher
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.testing._internal.distributed.fake_pg import FakeStore

from reference.measure.recorder import CollectiveRecorder
from reference.measure.torch_patches import replaced
from tests.ranks import on_ranks
from tests.reference.helpers import every_rank, megatron_parallel_state
from tests.reference.megatron_moe_on_cpu import megatron_moe_on_cpu

pytestmark = pytest.mark.upstream("megatron-lm")

WORLD = EP = 2
E, S, B, H = 4, 4, 2, 8  # experts; each rank's input [s, b, h]: T = s * b = 8 tokens
T = S * B
SEED = 1234
AUX_COEFF = 1e-2
CAPACITY = 0.5  # cap = ceil(T * k / E * 0.5): fewer slots than assignments, so some must drop
CASES = {
    "default": {},
    "aux": {"moe_aux_loss_coeff": AUX_COEFF},
    "alltoall": {"moe_token_dispatcher_type": "alltoall"},
    "capacity": {"moe_expert_capacity_factor": CAPACITY},
    "padded": {
        "moe_token_dispatcher_type": "alltoall",
        "moe_expert_capacity_factor": CAPACITY,
        "moe_pad_expert_input_to_capacity": True,
    },
}


def moe_layer(**overrides) -> MoELayer:
    """megatron's MoELayer with megatron-core's defaults but for the sizes, CPU initialization and `overrides`:
    the same router on every rank (one seed), each expert's weights drawn from a seed of its own (on the GPU
    megatron forks an expert-parallel RNG; on the CPU path every rank would draw the same experts)."""
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=1,
        num_moe_experts=E,
        expert_model_parallel_size=EP,
        use_cpu_initialization=True,
        **overrides,
    )
    spec = get_mlp_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    torch.manual_seed(SEED)
    layer = MoELayer(config, spec.submodules)
    layer.set_layer_number(1)  # where the router logs its auxiliary loss
    with torch.no_grad():
        for index, expert in zip(layer.local_expert_indices, layer.experts.local_experts):
            g = torch.Generator().manual_seed(SEED + 1 + index)
            for linear in (expert.linear_fc1, expert.linear_fc2):
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) * 0.5)
    return layer


def run(layer: MoELayer) -> dict:
    """One forward and backward of `layer` on this rank's tokens, and what megatron did on the way."""
    rank = dist.get_rank()
    routed, permutes, expert_inputs, experts_args = {}, [], {}, {}
    layer.router.register_forward_hook(
        lambda _m, _i, out: routed.update(probs=out[0].detach().tolist(), map=out[1].tolist())
    )
    layer.experts.register_forward_pre_hook(lambda _m, args: experts_args.update(tokens_per_expert=args[1].tolist()))
    for index, expert in zip(layer.local_expert_indices, layer.experts.local_experts):
        expert_inputs[index] = {}
        expert.register_forward_pre_hook(
            lambda _m, args, index=index: expert_inputs[index].update(
                rows=args[0].shape[0], tokens=args[0].detach().tolist(), scale=args[1].detach().tolist()
            )
        )
        expert.linear_fc2.register_forward_pre_hook(  # what fc2 multiplies: the activation, already weighted
            lambda _m, args, index=index: expert_inputs[index].update(fc2_input=args[0].detach().tolist())
        )

    def permute(original, tokens, routing_map, *args, **kwargs):
        permuted, probs, sorted_indices = original(tokens, routing_map, *args, **kwargs)
        permutes.append(
            {"rows": permuted.shape[0], "map": routing_map.int().tolist(), "order": sorted_indices.tolist()}
        )
        return permuted, probs, sorted_indices

    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(SEED + 100 + rank)).requires_grad_()
    dy = torch.randn(S, B, H, generator=torch.Generator().manual_seed(SEED + 200 + rank))
    moe_utils.clear_aux_losses_tracker()
    with replaced(token_dispatcher, "permute", permute), CollectiveRecorder() as rec:
        out, bias = layer(x)
        out.backward(dy)
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    dispatcher = layer.token_dispatcher
    split = lambda s: None if s is None else [int(v) for v in s]
    return {
        "k": layer.config.moe_router_topk,
        "activation": layer.config.activation_func.__name__,
        "ep_group": dist.get_process_group_ranks(layer.ep_group),
        "local_experts": list(layer.local_expert_indices),
        "x": x.detach().tolist(),
        "dy": dy.tolist(),
        "output": out.detach().tolist(),
        "bias": None if bias is None else bias.tolist(),
        "x_grad": x.grad.tolist(),
        "router": {
            "weight": layer.router.weight.detach().tolist(),
            "bias": None if layer.router.bias is None else layer.router.bias.detach().tolist(),
            "weight_grad": layer.router.weight.grad.tolist(),
        },
        "experts": {
            index: {
                "fc1": expert.linear_fc1.weight.detach().tolist(),
                "fc1_bias": expert.linear_fc1.bias.detach().tolist(),
                "fc2": expert.linear_fc2.weight.detach().tolist(),
                "fc2_bias": expert.linear_fc2.bias.detach().tolist(),
            }
            for index, expert in zip(layer.local_expert_indices, layer.experts.local_experts)
        },
        **routed,
        "permutes": permutes,
        "expert_inputs": expert_inputs,
        **experts_args,
        "events": [
            {"op": e.op, "nbytes": e.nbytes, "dtype": e.dtype, "phase": e.phase, "group": list(e.group_ranks)}
            for e in rec.events
        ],
        "input_splits": split(getattr(dispatcher, "input_splits", None)),
        "output_splits": split(getattr(dispatcher, "output_splits", None)),
        "capacity": getattr(dispatcher, "capacity", None),
        "aux_loss_logged": {name: entry["values"].tolist() for name, entry in tracker.items()},
    }


@functools.cache
def records() -> list[dict]:
    """Every case megatron ran, on every rank (computed once a rank, then gathered)."""
    with megatron_moe_on_cpu(), megatron_parallel_state(expert_model_parallel_size=EP):
        mine = {name: run(moe_layer(**overrides)) for name, overrides in CASES.items()}
    moe_utils.clear_aux_losses_tracker()
    return every_rank(mine)


def case(name: str) -> list[dict]:
    """`name`'s record of each rank, in rank order."""
    return [r[name] for r in records()]


def tensor(values) -> torch.Tensor:
    return torch.tensor(values)


def logits(record: dict) -> torch.Tensor:
    """The router's logits recomputed from its recorded weights: x W^T + b over the [T, h] tokens."""
    router = record["router"]
    bias = 0 if router["bias"] is None else tensor(router["bias"])
    return tensor(record["x"]).reshape(T, H) @ tensor(router["weight"]).t() + bias


def all_experts(records_of_case: list[dict]) -> dict[int, dict]:
    """Every expert's weights, from the rank that holds it."""
    return {int(i): w for record in records_of_case for i, w in record["experts"].items()}


def expert_output(weights: dict, x: torch.Tensor) -> torch.Tensor:
    """fc2(gelu(fc1 x)) of one expert (its biases zero at megatron's default initialization)."""
    hidden = F.gelu(x @ tensor(weights["fc1"]).t() + tensor(weights["fc1_bias"]))
    return hidden @ tensor(weights["fc2"]).t() + tensor(weights["fc2_bias"])


def mixture(record: dict, experts: dict[int, dict], k: int) -> torch.Tensor:
    """The MoE layer by its definition, test-side: each token's top-k experts by logit, weighted by the softmax of
    those k logits, summed."""
    top, chosen = logits(record).topk(k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    x = tensor(record["x"]).reshape(T, H)
    out = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            out[t] += weights[t, j] * expert_output(experts[int(chosen[t, j])], x[t])
    return out.reshape(S, B, H)


def forward(record: dict) -> list[tuple]:
    return [(e["op"], e["nbytes"], e["dtype"]) for e in record["events"] if e["phase"] == "forward"]


def backward(record: dict) -> list[tuple]:
    return [(e["op"], e["nbytes"], e["dtype"]) for e in record["events"] if e["phase"] == "backward"]


# ---- the router ----------------------------------------------------------------------------------------------
@on_ranks(WORLD)
def test_router_takes_the_top_k_logits_then_softmaxes_only_those(ranks):
    """TransformerConfig's defaults: k experts a token, chosen by logit (moe_router_pre_softmax False); the
    probabilities are the softmax of those k logits alone, so each token's sum to 1; the rest are zero."""
    for record in case("default"):
        k, routing_map, probs = record["k"], tensor(record["map"]), tensor(record["probs"])
        top, chosen = logits(record).topk(k, dim=-1)
        expected_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, chosen, True)
        assert torch.equal(routing_map, expected_map)
        assert (routing_map.sum(dim=1) == k).all()
        torch.testing.assert_close(probs.gather(1, chosen), torch.softmax(top, dim=-1))
        assert (probs[~routing_map] == 0).all()
        torch.testing.assert_close(probs.sum(dim=1), torch.ones(T))


def aux_loss(record: dict, k: int, tokens_per_expert: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """The switch load-balancing loss over this rank's tokens as a function of the router's weight:
    E * coeff / (k T^2) * sum_i (sum_t softmax(logits)_ti) * tokens_per_expert_i."""
    scores = torch.softmax(tensor(record["x"]).reshape(T, H) @ weight.t() + bias, dim=-1)
    return E * AUX_COEFF / (k * T * T) * (scores.sum(dim=0) * tokens_per_expert).sum()


@on_ranks(WORLD)
def test_load_balancing_loss_changes_no_forward_value_only_the_router_gradient(ranks):
    """moe_aux_loss_coeff > 0: the same routing and output (MoEAuxLossAutoScaler passes the probabilities through),
    and the router's weight gradient grows by exactly the gradient of the loss, whose token counts are this
    rank's own (its TP x CP group is itself): the ranks' counts differ, and the EP-wide sum would give another."""
    ranks_counts = [tensor(r["map"]).sum(dim=0).float() for r in case("aux")]
    assert not torch.equal(ranks_counts[0], ranks_counts[1])
    for rank, (plain, aux) in enumerate(zip(case("default"), case("aux"))):
        assert aux["map"] == plain["map"] and aux["probs"] == plain["probs"] and aux["output"] == plain["output"]
        k, bias = aux["k"], tensor(aux["router"]["bias"])
        weight = tensor(aux["router"]["weight"]).requires_grad_()
        loss = aux_loss(aux, k, ranks_counts[rank], weight, bias)
        (expected,) = torch.autograd.grad(loss, weight)
        added = tensor(aux["router"]["weight_grad"]) - tensor(plain["router"]["weight_grad"])
        torch.testing.assert_close(added, expected)
        assert not torch.allclose(expected, torch.zeros_like(expected))
        # what the router logs is the loss over its coefficient
        torch.testing.assert_close(tensor(aux["aux_loss_logged"]["load_balancing_loss"][0]), loss.detach() / AUX_COEFF)
        summed = aux_loss(aux, k, sum(ranks_counts), weight.detach(), bias)
        assert not torch.isclose(summed / AUX_COEFF, tensor(aux["aux_loss_logged"]["load_balancing_loss"][0]))
    for plain in case("default"):  # the default coefficient: no loss to log
        assert not any(plain["aux_loss_logged"].get("load_balancing_loss", []))


# ---- dropless and capacity -------------------------------------------------------------------------------------
@on_ranks(WORLD)
def test_dropless_by_default_every_assignment_reaches_its_expert(ranks):
    """No capacity factor: all T k assignments are kept, and each local expert is handed exactly the rows the
    ranks' maps send it, however uneven (the loads differ in this run)."""
    records_ = case("default")
    maps = [tensor(r["map"]) for r in records_]
    loads = sum(m.sum(dim=0) for m in maps)
    assert len(set(loads.tolist())) > 1  # uneven loads: nothing evens them out
    for record in records_:
        assert tensor(record["map"]).sum() == T * record["k"]
        local = record["local_experts"]
        assert record["tokens_per_expert"] == [int(loads[i]) for i in local]
        assert [record["expert_inputs"][i]["rows"] for i in local] == [int(loads[i]) for i in local]


@on_ranks(WORLD)
def test_capacity_factor_drops_the_lowest_probability_assignments(ranks):
    """moe_expert_capacity_factor c: each expert keeps at most ceil(c T k / E) of a rank's assignments, the ones
    of highest probability (moe_token_drop_policy 'probs'); the rest are dropped, not padded."""
    for plain, capped in zip(case("default"), case("capacity")):
        k = plain["k"]
        cap = math.ceil(T * k / E * CAPACITY)
        before, after = tensor(plain["map"]), tensor(capped["map"])
        probs = tensor(plain["probs"])
        assert after.sum() < before.sum()  # something was dropped
        assert (after & ~before).sum() == 0  # nothing added
        for e in range(E):
            kept, routed = after[:, e], before[:, e]
            assert int(kept.sum()) == min(cap, int(routed.sum()))
            if (routed & ~kept).any():
                assert probs[routed & ~kept, e].max() <= probs[kept, e].min()
        torch.testing.assert_close(tensor(capped["probs"]), probs * after)


@on_ranks(WORLD)
def test_padding_to_capacity_fills_every_expert_and_fixes_the_all_to_all(ranks):
    """moe_pad_expert_input_to_capacity: every expert gets exactly `capacity` rows from every rank (padding rows
    weigh 0), so the alltoall dispatcher exchanges no counts and sends equal splits of capacity x E rows."""
    for record in case("padded"):
        cap = record["capacity"]
        assert cap == math.ceil(T * record["k"] / E * CAPACITY)
        assert (tensor(record["map"]).sum(dim=0) == cap).all()
        assert record["tokens_per_expert"] == [cap * EP] * (E // EP)
        rows = cap * E * H * 4
        assert forward(record) == [("all_to_all", rows, "float32"), ("all_to_all", cap * E * 4, "float32")] + [
            ("all_to_all", rows, "float32")
        ]
        assert record["input_splits"] is None  # equal splits: all_to_all_single without sizes


# ---- permute and unpermute -------------------------------------------------------------------------------------
@on_ranks(WORLD)
def test_permute_orders_the_assignments_expert_major_one_row_each(ranks):
    """moe_utils.permute turns the [T, E] map into rows grouped by expert, each expert's tokens in sequence order,
    one row per assignment: T k rows before the alltoall dispatcher's all-to-all."""
    for record in case("alltoall"):
        (call,) = record["permutes"]
        routing_map = call["map"]
        assert call["order"] == [t for e in range(E) for t in range(T) if routing_map[t][e]]
        assert call["rows"] == T * record["k"]


@on_ranks(WORLD)
def test_experts_weigh_their_rows_and_the_k_copies_are_summed(ranks):
    """Each expert is handed its rows' routing probabilities and scales its activation by them before fc2;
    unpermute adds the k weighted copies back into their token's row: the output is the mixture, computed
    test-side from megatron's weights, under either dispatcher."""
    for name in ("default", "alltoall"):
        records_ = case(name)
        experts = all_experts(records_)
        for record in records_:
            assert record["activation"] == "gelu"  # TransformerConfig's activation_func, as mixture() applies it
            torch.testing.assert_close(tensor(record["output"]), mixture(record, experts, record["k"]))
            for e in record["local_experts"]:  # rank 0's rows routed to e, then rank 1's, each in token order
                handed = record["expert_inputs"][e]
                expected = [p[e] for r in records_ for p, m in zip(r["probs"], r["map"]) if m[e]]
                torch.testing.assert_close(tensor(handed["scale"]), tensor(expected))
                fc1, bias = tensor(experts[e]["fc1"]), tensor(experts[e]["fc1_bias"])
                activation = F.gelu(tensor(handed["tokens"]) @ fc1.t() + bias)
                torch.testing.assert_close(tensor(handed["fc2_input"]), activation * tensor(expected)[:, None])


# ---- the dispatchers -------------------------------------------------------------------------------------------
@on_ranks(WORLD)
def test_allgather_dispatcher_gathers_every_token_and_reduce_scatters_back(ranks):
    """The default dispatcher: over the EP group, all-gather the routing map, the probabilities and all tokens;
    after the local experts, reduce-scatter the [EP T, h] result back to each rank's own tokens."""
    for record in case("default"):
        assert record["ep_group"] == [0, 1]
        assert forward(record) == [
            ("all_gather", EP * T * E, "bool"),
            ("all_gather", EP * T * E * 4, "float32"),
            ("all_gather", EP * T * H * 4, "float32"),
            ("reduce_scatter", EP * T * H * 4, "float32"),
        ]
        assert {e["group"] == [0, 1] for e in record["events"]} == {True}


def splits_from_maps(records_: list[dict], rank: int) -> tuple[list[int], list[int]]:
    """What rank `rank` sends each EP rank (its assignments to that rank's experts) and receives from each (their
    assignments to its experts), read from the routing maps."""
    maps = [tensor(r["map"]) for r in records_]
    owner = lambda m, peer: int(m[:, peer * (E // EP) : (peer + 1) * (E // EP)].sum())
    return [owner(maps[rank], peer) for peer in range(EP)], [owner(maps[peer], rank) for peer in range(EP)]


@on_ranks(WORLD)
def test_alltoall_dispatcher_exchanges_counts_first_then_sends_only_routed_rows(ranks):
    """The alltoall dispatcher all-gathers each rank's [E] tokens-per-expert counts; the split sizes follow: send
    to each peer its experts' assignments, receive theirs for mine. Then two all-to-alls out (the T k rows, their
    probabilities) and one back (what my experts computed); backward runs them in reverse."""
    records_ = case("alltoall")
    for rank, record in enumerate(records_):
        sent, received = splits_from_maps(records_, rank)
        assert (record["input_splits"], record["output_splits"]) == (sent, received)
        rows_out, rows_in = sum(sent), sum(received)
        assert rows_out == T * record["k"] and rows_in == sum(record["tokens_per_expert"])
        assert forward(record) == [
            ("all_gather", EP * E * 8, "int64"),
            ("all_to_all", rows_out * H * 4, "float32"),
            ("all_to_all", rows_out * 4, "float32"),
            ("all_to_all", rows_in * H * 4, "float32"),
        ]
        assert sorted(backward(record)) == sorted(
            [
                ("all_to_all", rows_out * H * 4, "float32"),
                ("all_to_all", rows_in * H * 4, "float32"),
                ("all_to_all", rows_in * 4, "float32"),
            ]
        )


@on_ranks(WORLD)
def test_both_dispatchers_compute_the_same_layer(ranks):
    """Same weights, same tokens: the allgather and alltoall dispatchers give the same output and gradients."""
    for gathered, exchanged in zip(case("default"), case("alltoall")):
        for key in ("output", "x_grad"):
            torch.testing.assert_close(tensor(exchanged[key]), tensor(gathered[key]))
        torch.testing.assert_close(
            tensor(exchanged["router"]["weight_grad"]), tensor(gathered["router"]["weight_grad"])
        )


# ---- the expert-parallel groups --------------------------------------------------------------------------------
LAYOUTS = [  # world 8: (tp, cp, pp, ep, expert tp)
    {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2},
    {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "expert_model_parallel_size": 2},
    {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 4},
    {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1},
]


def megatron_groups(world: int, sizes: dict) -> list[dict]:
    """Each rank's groups from megatron's initialize_model_parallel(**sizes), this process posing as every rank of
    `world` in turn (torch's fake backend: groups are made, nothing is sent)."""
    from megatron.core import parallel_state as mpu

    found = []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mpu.initialize_model_parallel(**sizes, create_gloo_process_groups=False)
            ranks = dist.get_process_group_ranks
            found.append(
                {
                    "tp": ranks(mpu.get_tensor_model_parallel_group()),
                    "dp_cp": ranks(mpu.get_data_parallel_group(with_context_parallel=True)),
                    "tp_dp_cp": ranks(mpu.get_tensor_and_data_parallel_group(with_context_parallel=True)),
                    "ep": ranks(mpu.get_expert_model_parallel_group()),
                    "expert_tp": ranks(mpu.get_expert_tensor_parallel_group()),
                    "expert_dp": ranks(mpu.get_expert_data_parallel_group()),
                }
            )
            mpu.destroy_model_parallel()
        finally:
            dist.destroy_process_group()
    return found


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "-".join(f"{k.split('_')[0]}{v}" for k, v in s.items()))
def test_expert_groups_split_the_data_and_context_parallel_ranks(sizes):
    """Expert TP defaults to TP; then each EP group and each expert-DP group lies inside one DP x CP group and
    the two split it (EP x expert DP = DP x CP): experts are spread where the dense layers replicate. With
    expert TP 1 under TP 2, the EP group takes TP ranks too (inside TP x DP x CP)."""
    world = 8
    for rank, groups in enumerate(megatron_groups(world, sizes)):
        assert rank in groups["ep"] and len(groups["ep"]) == sizes["expert_model_parallel_size"]
        if "expert_tensor_parallel_size" not in sizes:
            assert groups["expert_tp"] == groups["tp"]
            assert set(groups["ep"]) <= set(groups["dp_cp"]) and set(groups["expert_dp"]) <= set(groups["dp_cp"])
            assert len(groups["ep"]) * len(groups["expert_dp"]) == len(groups["dp_cp"])
        else:
            assert groups["expert_tp"] == [rank] and not set(groups["ep"]) <= set(groups["dp_cp"])
            assert set(groups["ep"]) <= set(groups["tp_dp_cp"])

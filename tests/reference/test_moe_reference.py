"""reference.moe against the unsharded MoE layer and against megatron-core 0.16.1's MoELayer, on 2 and 4 ranks:

* at EP 2, EP 4 and EP 2 x TP 2, dropless and with a capacity factor (GELU experts), and dropless with SwiGLU experts,
  every rank's output and input gradient, the router's gradient and every expert's gradient (this rank's experts, its
  TP slice) equal the unsharded layer's, which runs in one process on every rank's tokens. Dropless, the unsharded
  layer takes each TP group's whole sequence, the load-balancing loss on: the loss counts the group's tokens. With a
  capacity factor it takes each rank's slice alone, since capacity is counted per slice (as megatron does); at TP 2
  the loss is then off, its counts being the group's;
* the all-to-alls carry the closed form's bytes: E counts, then one row of h floats per routed (token,
  expert) pair sent, and per pair received, forward, and the same rows reversed in backward;
* megatron-core's MoELayer (SequentialMLP experts from get_mlp_module_spec(use_te=False), the AllGather
  dispatcher) with the same weights gives the same outputs and gradients at EP 2, in all three.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from reference.measure.recorder import CollectiveRecorder
from reference.measure.torch_patches import cuda_calls_on_cpu
from reference.moe.layer import MoELayer
from reference.moe.parallelize import parallelize_moe
from reference.parallel_state import build_layout
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES
from tests.reference.helpers import assert_close, groups_of_the_block, megatron_parallel_state

H, FFN, E, K, S, B = 8, 16, 8, 2, 8, 2  # hidden, expert ffn, experts, top-k, sequence, micro-batch
AUX = 1e-2
CAPACITY = 1.0  # ceil(T k / E): tight enough that experts overflow
# dropless and capacity with GELU experts (megatron's default activation), and dropless with SwiGLU experts
MODES = {"dropless": {}, "capacity": {"capacity_factor": CAPACITY}, "swiglu": {"gated": True}}


def layouts(world: int) -> list[tuple[int, int]]:
    """(ep, tp) compared at this world size: EP = world, and at 4 ranks EP 2 x TP 2."""
    return [(world, 1)] + ([(2, 2)] if world == 4 else [])


def sequence(g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TP group g's whole input [S, B, H] and the weights of its loss sum(out * w)."""
    gen = torch.Generator().manual_seed(100 + g)
    return torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)


def options(mode: str, tp: int) -> dict:
    aux = 0.0 if mode == "capacity" and tp > 1 else AUX  # per-slice capacity, whole-sequence counts: see above
    return {**MODES[mode], "aux_loss_coeff": aux}


def expert_grads(layer: MoELayer) -> dict[str, torch.Tensor]:
    return {
        f"{layer.experts.first + i}.{n}": p.grad
        for i, e in enumerate(layer.experts.local_experts)
        for n, p in e.named_parameters()
    }


def unsharded(mode: str, ep: int, tp: int, device) -> dict:
    """The plain layer on every routing unit of the run (each TP group's sequence, or each rank's slice):
    outputs per unit, router gradient per unit, expert gradients summed over all units."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    layer = MoELayer(H, FFN, E, K, device=device, **options(mode, tp))
    experts = [p for e in layer.experts.local_experts for p in e.parameters()]
    per_slice = mode == "capacity"
    units = {}
    for g in range(world // tp):
        x, w = sequence(g)
        parts = zip(x.chunk(tp), w.chunk(tp)) if per_slice else [(x, w)]
        for t, (xu, wu) in enumerate(parts):
            xu, wu = xu.to(device).requires_grad_(), wu.to(device)
            out = layer(xu)
            grads = torch.autograd.grad((out * wu).sum(), [xu, layer.router.weight, *experts])
            units[(g, t)] = {"out": out.detach(), "input": grads[0], "router": grads[1], "experts": grads[2:]}
    summed = [sum(u["experts"][i] for u in units.values()) for i in range(len(experts))]
    with torch.no_grad():  # the unsharded layer's expert gradients, named as expert_grads names them
        for p, grad in zip(experts, summed):
            p.grad = grad
    return {"units": units, "experts": expert_grads(layer), "per_slice": per_slice, "router": layer.router}


def sharded(mode: str, ep: int, tp: int, device) -> dict:
    """The same layer split by parallelize_moe, each rank on its slice of its TP group's sequence."""
    # megatron's placement: TP groups of consecutive ranks, EP groups of the ranks with the same TP index
    layout = build_layout(tp_size=tp, ep_size=ep)
    ep_group, tp_group, g, t = layout.ep_group, layout.tp_group, layout.dp_rank, layout.tp_rank
    torch.manual_seed(0)
    layer = parallelize_moe(MoELayer(H, FFN, E, K, device=device, **options(mode, tp)), layout)
    x, w = (part.chunk(tp)[t].to(device) for part in sequence(g))
    x.requires_grad_()  # as a layer's input is: the dispatch all-to-all then has a backward too
    with CollectiveRecorder() as rec:
        out = layer(x)
        (out * w).sum().backward()
    allreduce_sequence_parallel_grads(layer, tp_group)  # the router saw this rank's slice only
    a2a = [(e.phase, e.nbytes, e.group_ranks) for e in rec.events if e.op == "all_to_all"]
    return {
        "g": g,
        "t": t,
        "x": x,
        "out": out.detach(),
        "input": x.grad,
        "router": layer.router.weight.grad,
        "experts": expert_grads(layer),
        "a2a": a2a,
        "ep_ranks": tuple(dist.get_process_group_ranks(ep_group)),
        "experts_here": range(layer.experts.first, layer.experts.first + len(layer.experts.local_experts)),
    }


def routed_pairs(router, x: torch.Tensor, experts=None) -> int:
    """(token, expert) pairs the router sends from `x` (to `experts` only, if given), after any drop."""
    with torch.no_grad():
        routing_map = router(x.detach().reshape(-1, H))[1]
    return int(routing_map[:, list(experts) if experts is not None else slice(None)].sum())


def compare(mode: str, ep: int, tp: int, device) -> dict:
    """Assert the sharded run equals the unsharded one on this rank; return what the tests look at."""
    what = f"{mode} ep {ep} tp {tp} rank {dist.get_rank()}"
    with groups_of_the_block():
        mine = sharded(mode, ep, tp, device)
    ref = unsharded(mode, ep, tp, device)
    g, t, units = mine["g"], mine["t"], ref["units"]
    if ref["per_slice"]:
        unit = units[(g, t)]
        out, grad_in, router = unit["out"], unit["input"], sum(units[(g, s)]["router"] for s in range(tp))
    else:
        unit = units[(g, 0)]
        out, grad_in, router = unit["out"].chunk(tp)[t], unit["input"].chunk(tp)[t], unit["router"]
    assert_close(mine["out"], out, f"{what}: output", atol=1e-6, rtol=1e-5)
    assert_close(mine["input"], grad_in, f"{what}: input gradient", atol=1e-6, rtol=1e-5)
    assert_close(mine["router"], router, f"{what}: router gradient", atol=1e-6, rtol=1e-5)
    for name, grad in mine["experts"].items():
        full = ref["experts"][name]
        if tp > 1 and name.endswith("fc1.weight"):  # split by output rows; SwiGLU: its 1/tp of gate and of up
            parts = 2 if mode == "swiglu" else 1
            full = torch.cat(full.chunk(parts * tp, dim=0)[t::tp])
        elif tp > 1:  # fc2: split by input columns
            full = full.chunk(tp, dim=1)[t]
        assert_close(grad, full, f"{what}: expert {name} gradient", atol=1e-6, rtol=1e-5)
    # the closed form: what the router routes from each EP peer's tokens (the unsharded router, same weights)
    router_ = ref["router"]
    peers = [q for q in mine["ep_ranks"]]
    xs = {q: sequence(q // tp)[0].chunk(tp)[q % tp].to(device) for q in peers}
    sent = routed_pairs(router_, mine["x"])
    received = sum(routed_pairs(router_, xs[q], mine["experts_here"]) for q in peers)
    row = H * 4  # fp32
    expected = sorted(
        [("forward", E * 8), ("forward", sent * row), ("forward", received * row)]
        + [("backward", sent * row), ("backward", received * row)]
    )
    dropped = K * S * B // tp - sent
    return {
        "what": what,
        "a2a": sorted((phase, nbytes) for phase, nbytes, _ in mine["a2a"]),
        "a2a_groups": {ranks for _, _, ranks in mine["a2a"]},
        "expected_a2a": expected,
        "ep_ranks": mine["ep_ranks"],
        "dropped": dropped,
    }


@functools.cache
def results(device: torch.device) -> dict:
    """Every (mode, layout) at this world size, compared once a rank (each comparison asserted on the way)."""
    return {
        (mode, ep, tp): compare(mode, ep, tp, device) for mode in MODES for ep, tp in layouts(dist.get_world_size())
    }


@on_ranks(2, 4, devices=DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
def test_moe_equals_the_unsharded_layer(ranks, mode):
    found = {key: r for key, r in results(ranks.device).items() if key[0] == mode}
    assert [key[1:] for key in found] == layouts(ranks.world)
    if mode == "capacity":  # the mode is exercised: some pairs were dropped, somewhere in the world
        dropped = torch.tensor([float(sum(r["dropped"] for r in found.values()))], device=ranks.device)
        dist.all_reduce(dropped)
        assert dropped.item() > 0
    else:
        assert all(r["dropped"] == 0 for r in found.values())


@on_ranks(2, 4, devices=DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
def test_moe_all_to_all_bytes_equal_the_closed_form(ranks, mode):
    for (m, _, _), r in results(ranks.device).items():
        if m == mode:
            assert r["a2a_groups"] == {r["ep_ranks"]}, r["what"]
            assert r["a2a"] == r["expected_a2a"], r["what"]


# ---- megatron-core's groups and MoELayer ------------------------------------------------------------------
def expert_layouts(world: int) -> list[tuple[int, int, int, str]]:
    """(tp, pp, ep, order) whose groups are compared with megatron's at this world size."""
    if world == 2:
        return [(1, 1, 2, "tp-pp-dp")]
    return [(1, 1, 2, "tp-pp-dp"), (1, 1, 4, "tp-dp-pp"), (2, 1, 2, "tp-pp-dp"), (1, 2, 2, "tp-dp-pp")]


@functools.cache
def layout_groups(device: torch.device) -> list[dict]:
    """Per layout, this rank's EP, expert-DP and TP groups: build_layout's and megatron's
    initialize_model_parallel's."""
    from megatron.core import parallel_state as mpu

    found = []
    for tp, pp, ep, order in expert_layouts(dist.get_world_size()):
        with groups_of_the_block():
            layout = build_layout(tp, pp, order=order, ep_size=ep)
            with megatron_parallel_state(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                expert_model_parallel_size=ep,
                order=order.replace("tp-", "tp-cp-ep-"),
            ):
                found.append(
                    {
                        name: [dist.get_process_group_ranks(ours), dist.get_process_group_ranks(theirs)]
                        for name, ours, theirs in [
                            ("ep", layout.ep_group, mpu.get_expert_model_parallel_group()),
                            ("expert dp", layout.expert_dp_group, mpu.get_expert_data_parallel_group()),
                            ("expert tp = tp", layout.tp_group, mpu.get_expert_tensor_parallel_group()),
                        ]
                    }
                    | {"what": f"tp {tp} pp {pp} ep {ep} {order}"}
                )
    return found


@on_ranks(2, 4, devices=DEVICES)
@pytest.mark.upstream("megatron-lm")  # megatron-core's initialize_model_parallel builds its groups in it
def test_expert_groups_equal_megatron_core_parallel_state(ranks):
    found = layout_groups(ranks.device)
    assert [f["what"].split()[1::2] for f in found] == [
        [str(tp), str(pp), str(ep)] for tp, pp, ep, _ in expert_layouts(ranks.world)
    ]
    for layout in found:
        for name, (ours, theirs) in ((k, v) for k, v in layout.items() if k != "what"):
            assert ours == theirs, f"{layout['what']} rank {ranks.rank}: {name} group {ours} vs megatron {theirs}"


# ---- megatron-core's MoELayer, same weights ---------------------------------------------------------------
def megatron_moe(mode: str):
    """megatron-core's MoELayer at EP = world: SequentialMLP experts without Transformer Engine, the AllGather
    dispatcher, the reference's shapes and options."""
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not hasattr(moe_utils, "te_general_gemm"):  # bound only when Transformer Engine imports; read regardless
        moe_utils.te_general_gemm = None
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_aux_loss_coeff=AUX,
        moe_expert_capacity_factor=MODES[mode].get("capacity_factor"),
        gated_linear_unit=mode == "swiglu",  # fc1 = [gate; up], silu(gate) * up, as the reference's swiglu
        activation_func=torch.nn.functional.silu if mode == "swiglu" else torch.nn.functional.gelu,
        moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=dist.get_world_size(),
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    spec = get_mlp_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    return MegatronMoELayer(config, spec.submodules)


def against_megatron(mode: str, device) -> dict:
    from megatron.core import parallel_state as mpu

    world, rank = dist.get_world_size(), dist.get_rank()
    with megatron_parallel_state(expert_model_parallel_size=world):
        torch.manual_seed(1)
        theirs = megatron_moe(mode).to(device)
        torch.manual_seed(1)
        ours = parallelize_moe(
            MoELayer(H, FFN, E, K, device=device, aux_loss_coeff=AUX, **MODES[mode]),
            mpu.get_expert_model_parallel_group(),
        )
        with torch.no_grad():  # megatron's weights into ours: the gate, and this rank's experts
            ours.router.weight.copy_(theirs.router.weight)
            for mine, their in zip(ours.experts.local_experts, theirs.experts.local_experts):
                mine.fc1.weight.copy_(their.linear_fc1.weight)
                mine.fc2.weight.copy_(their.linear_fc2.weight)
        x, w = (t.to(device) for t in sequence(rank))
        found = {}
        for name, layer in (("reference", ours), ("megatron", theirs)):
            xi = x.clone().requires_grad_()
            out = layer(xi)
            out = out[0] if isinstance(out, tuple) else out  # megatron returns (output, bias)
            (out * w).sum().backward()
            found[name] = [out.detach(), xi.grad] + [p.grad for p in layer.parameters()]
    return found


@functools.cache
def megatron_results(device: torch.device) -> dict:
    if device.type == "cpu":
        cuda_calls_on_cpu()  # megatron's router moves its weight to torch.cuda.current_device()
    return {mode: against_megatron(mode, device) for mode in MODES}


@on_ranks(2, devices=DEVICES)
@pytest.mark.upstream("megatron-lm")  # megatron-core's MoELayer runs in it
@pytest.mark.parametrize("mode", list(MODES))
def test_moe_equals_megatron_core_moe_layer(ranks, mode):
    found = megatron_results(ranks.device)[mode]
    names = ["output", "input grad", "router grad"] + [f"expert {i} {n}" for i in range(E // 2) for n in ("fc1", "fc2")]
    assert len(found["reference"]) == len(found["megatron"]) == len(names)
    for name, a, b in zip(names, found["reference"], found["megatron"]):
        assert_close(a, b, f"{mode} rank {ranks.rank}: {name}", atol=1e-6, rtol=1e-5)

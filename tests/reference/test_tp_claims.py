"""The claims the reading notes make about Megatron-style tensor parallelism, checked on recorded runs.

At each world size every rank records a training step of a one-block TP transformer in four configurations
(`recorded()`, once a rank) and each test reads its rank's logs. Activations are [s, b, h] = [8, 2, 16] in
fp32, so one activation is N = b*s*h*4 = 1024 bytes.
"""

import functools

import torch
import torch.distributed as dist

from reference.gpt.model import gpt_blocks
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.parallelize import parallelize
from reference.tensor_parallel.transformer import init_method_normal
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES
from tests.reference.helpers import assert_close, gather_dim

B, S, H, HEADS = 2, 8, 16, 4


def record_step(tp, device, **kwargs) -> dict:
    torch.manual_seed(0)
    model = parallelize(gpt_blocks(1, H, HEADS, device=device), tp, **kwargs)
    x = torch.randn(S, B, H, device=device, requires_grad=True)
    with CollectiveRecorder() as rec:
        rec.watch(model)
        (model(None, None, hidden=x) ** 2).sum().backward()
    assert x.element_size() == 4  # fp32: one activation is N = b*s*h*4 bytes
    return rec.to_dict()


def check_ffn_derivation(tp, device) -> list:
    """Y = GELU(X A) B with A split by columns, B by rows, spelled out (the 2-way derivation, on p ranks);
    returns the backward's collectives."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1)
    fc1 = ColumnParallelLinear(H, 4 * H, tp_group=tp, init_method=init_method_normal(), bias=False, device=device)
    fc2 = RowParallelLinear(
        4 * H, H, tp_group=tp, init_method=init_method_normal(), bias=False, input_is_parallel=True, device=device
    )
    torch.manual_seed(1)
    full_a, full_b = (torch.empty(4 * H, H), torch.empty(H, 4 * H))
    init_method_normal()(full_a), init_method_normal()(full_b)
    full_a, full_b = full_a.to(device), full_b.to(device)
    x = torch.randn(S, B, H, device=device)

    # 1. the column shards O_i = X A_i concatenate to O = X A: no communication needed to produce them
    xr = x.clone().requires_grad_()
    o_i, _ = fc1(xr)
    o_full = x @ full_a.t()
    assert_close(gather_dim(o_i.detach(), -1, tp), o_full, "O shards concatenate to O")
    # 2. the row partials Y_i = GELU(O_i) B_i sum to Y; one alone is not Y (hence the all-reduce)
    h_i = torch.nn.functional.gelu(o_i)
    partial = h_i.detach() @ fc2.weight.detach().t()
    y_full = torch.nn.functional.gelu(o_full) @ full_b.t()
    assert_close(sum(gather_dim(partial.unsqueeze(0), 0, tp)), y_full, "partial Y_i sum to Y")
    assert not torch.allclose(partial, y_full, atol=1e-4), "a single partial Y_i should not already be Y"
    y, _ = fc2(h_i)
    assert_close(y, y_full, "row layer output after its all-reduce")
    # 3. dX: each rank's dO_i A_i is partial; their sum (the all-reduce in the column backward) is dX
    with CollectiveRecorder() as rec:
        y.backward(torch.ones_like(y))
    xf = x.clone().requires_grad_()
    ((torch.nn.functional.gelu(xf @ full_a.t()) @ full_b.t()).sum()).backward()
    assert_close(xr.grad, xf.grad, "dX after the all-reduce")
    o_i2 = (x @ fc1.weight.detach().t()).requires_grad_()
    (torch.nn.functional.gelu(o_i2) @ fc2.weight.detach().t()).sum().backward()
    local_dx = o_i2.grad @ fc1.weight.detach()
    assert not torch.allclose(local_dx, xf.grad, atol=1e-4), "one rank's dO_i A_i should not already be dX"
    assert_close(sum(gather_dim(local_dx.unsqueeze(0), 0, tp)), xf.grad, "sum of dO_i A_i is dX")
    # 4. dW is local: each rank's weight grads are slices of the full ones, and the only backward
    #    collective is the one all-reduce of dX, [s, b, h]
    full_a_req, full_b_req = full_a.clone().requires_grad_(), full_b.clone().requires_grad_()
    (torch.nn.functional.gelu(x @ full_a_req.t()) @ full_b_req.t()).sum().backward()
    assert_close(fc1.weight.grad, full_a_req.grad.chunk(world, 0)[rank], "dA_i is the local slice of dA")
    assert_close(fc2.weight.grad, full_b_req.grad.chunk(world, 1)[rank], "dB_i is the local slice of dB")
    return [(e.op, e.shape) for e in rec.events]


def check_grad_accumulation_fusion(tp, device) -> dict:
    """Two micro-batches accumulate into weight.main_grad (equal to the plain model's grad); weight.grad is
    never materialized."""
    torch.manual_seed(2)
    model = parallelize(gpt_blocks(1, H, HEADS, device=device), tp, gradient_accumulation_fusion=True)
    torch.manual_seed(2)
    plain = gpt_blocks(1, H, HEADS, device=device)
    for _micro_batch in range(2):
        x = torch.randn(S, B, H, device=device)
        (model(None, None, hidden=x) ** 2).sum().backward()
        (plain(None, None, hidden=x) ** 2).sum().backward()
    fc1 = model.layers[0].mlp.fc1.weight
    assert_close(gather_dim(fc1.main_grad, 0, tp), plain.layers[0].mlp.fc1.weight.grad, "fc1 main_grad")
    fc2 = model.layers[0].mlp.fc2.weight
    assert_close(gather_dim(fc2.main_grad, 1, tp), plain.layers[0].mlp.fc2.weight.grad, "fc2 main_grad")
    return {"fc1_grad_is_none": fc1.grad is None, "fc1_main_grad_dtype": str(fc1.main_grad.dtype)}


def check_dropout_streams(tp, device) -> dict:
    """Replicated activations get the same mask on every TP rank, split ones an independent mask per rank."""
    observed = {}
    get_state = torch.cuda.get_rng_state if device.type == "cuda" else torch.get_rng_state
    set_state = torch.cuda.set_rng_state if device.type == "cuda" else torch.set_rng_state
    for sp in (False, True):
        torch.manual_seed(3)
        model = parallelize(
            gpt_blocks(1, H, HEADS, hidden_dropout=0.3, attention_dropout=0.3, device=device),
            tp,
            sequence_parallel=sp,
            dropout_seed=9,
        )
        x = torch.randn(S, B, H, device=device)
        out = model(None, None, hidden=x).detach()
        replicas = gather_dim(out.unsqueeze(0), 0, tp)
        observed[f"sp={sp}"] = {
            "replicas_equal": all(torch.equal(r, replicas[0]) for r in replicas),
            "eval_differs": not torch.allclose(model.eval()(None, None, hidden=x), out),
        }
    saved = get_state()
    with model.layers[0].rng.fork():
        sharded_draw = torch.rand(8, device=device)
    after_fork = torch.rand(8, device=device)
    set_state(saved)
    observed["default_stream_kept"] = torch.equal(after_fork, torch.rand(8, device=device))
    draws = gather_dim(sharded_draw.unsqueeze(0), 0, tp)
    observed["distinct_sharded_draws"] = len({tuple(d.tolist()) for d in draws})
    return observed


@functools.cache
def recorded(device: torch.device) -> dict:
    """Each configuration's recorded step, and what the per-rank checks observed: computed once a rank (the
    checks' tensor equalities asserted on the way, naming the tensor)."""
    tp = build_layout(tp_size=dist.get_world_size()).tp_group
    logs = {
        "tp": record_step(tp, device),
        "sp": record_step(tp, device, sequence_parallel=True),
        "tp_no_async": record_step(tp, device, async_grad_allreduce=False),
        "sp_no_async": record_step(tp, device, sequence_parallel=True, async_grad_allreduce=False),
    }
    return {
        "logs": logs,
        "ffn_backward_collectives": check_ffn_derivation(tp, device),
        "grad_accumulation_fusion": check_grad_accumulation_fusion(tp, device),
        "dropout": check_dropout_streams(tp, device),
    }


def events(run, config, phase=None, module_prefix=""):
    return [
        e
        for e in run["logs"][config]["events"]
        if (phase is None or e["phase"] == phase) and e["module"].startswith(module_prefix)
    ]


def ops(evs):
    return [(e["op"], e["module"]) for e in evs]


@on_ranks(2, 4, devices=DEVICES)
def test_one_allreduce_per_mlp_forward_and_backward(ranks):
    run = recorded(ranks.device)
    assert ops(events(run, "tp", "forward", "layers.0.mlp")) == [("all_reduce", "layers.0.mlp.fc2")]
    assert ops(events(run, "tp", "backward", "layers.0.mlp")) == [("all_reduce", "layers.0.mlp.fc1")]


@on_ranks(2, 4, devices=DEVICES)
def test_two_allreduces_per_block_each_way_without_sequence_parallel(ranks):
    run = recorded(ranks.device)
    assert ops(events(run, "tp", "forward")) == [
        ("all_reduce", "layers.0.attention.proj"),
        ("all_reduce", "layers.0.mlp.fc2"),
    ]
    assert ops(events(run, "tp", "backward")) == [
        ("all_reduce", "layers.0.mlp.fc1"),
        ("all_reduce", "layers.0.attention.qkv"),
    ]


@on_ranks(2, 4, devices=DEVICES)
def test_bytes_per_collective_equal_b_s_h_dtype_size(ranks):
    run = recorded(ranks.device)
    n = B * S * H * 4
    for config in ("tp", "sp"):
        block = events(run, config, module_prefix="layers.0")
        assert block and {e["nbytes"] for e in block} == {n}, [(e["op"], e["nbytes"]) for e in block]
        assert all(e["group_ranks"] == tuple(range(ranks.world)) for e in block)


def _ring_bytes(evs, p):
    """Bytes each rank sends with ring algorithms: all-reduce 2(p-1)/p N, all-gather and reduce-scatter (p-1)/p N."""
    per_op = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p}
    return sum(per_op[e["op"]] * e["nbytes"] for e in evs)


@on_ranks(2, 4, devices=DEVICES)
def test_sequence_parallel_turns_allreduce_into_allgather_and_reducescatter_of_equal_volume(ranks):
    run = recorded(ranks.device)
    p, n = ranks.world, B * S * H * 4
    tp_fwd, sp_fwd = (
        events(run, "tp", phase="forward", module_prefix="layers.0"),
        events(run, "sp", phase="forward", module_prefix="layers.0"),
    )
    assert ops(sp_fwd) == [
        ("all_gather", "layers.0.attention.qkv"),
        ("reduce_scatter", "layers.0.attention.proj"),
        ("all_gather", "layers.0.mlp.fc1"),
        ("reduce_scatter", "layers.0.mlp.fc2"),
    ]
    assert _ring_bytes(sp_fwd, p) == _ring_bytes(tp_fwd, p) == 4 * (p - 1) / p * n
    # Backward: the conjugates (all-gather for each reduce-scatter, reduce-scatter of dX for each all-reduce)
    # carry the same volume; on top, each column layer re-gathers its input (not kept, to save memory).
    sp_bwd = events(run, "sp", phase="backward", module_prefix="layers.0")
    assert ops(sp_bwd) == [
        ("all_gather", "layers.0.mlp.fc2"),
        ("all_gather", "layers.0.mlp.fc1"),
        ("reduce_scatter", "layers.0.mlp.fc1"),
        ("all_gather", "layers.0.attention.proj"),
        ("all_gather", "layers.0.attention.qkv"),
        ("reduce_scatter", "layers.0.attention.qkv"),
    ]
    regathers = [e for e in sp_bwd if e["op"] == "all_gather" and e["async_op"]]
    assert [e["module"] for e in regathers] == ["layers.0.mlp.fc1", "layers.0.attention.qkv"]
    conjugates = [e for e in sp_bwd if e not in regathers]
    tp_bwd = events(run, "tp", phase="backward", module_prefix="layers.0")
    assert _ring_bytes(conjugates, p) == _ring_bytes(tp_bwd, p) == 4 * (p - 1) / p * n


@on_ranks(2, 4, devices=DEVICES)
def test_input_grad_collective_is_async_unless_disabled(ranks):
    run = recorded(ranks.device)
    for config, overlapped in (("tp", True), ("sp", True), ("tp_no_async", False), ("sp_no_async", False)):
        dgrad = [
            e
            for e in events(run, config, phase="backward", module_prefix="layers.0")
            if e["module"].endswith(("qkv", "fc1"))
        ]
        assert dgrad and all(e["async_op"] is overlapped for e in dgrad), (config, dgrad)
        assert all(e["end"] >= e["start"] for e in dgrad)
    strip = lambda evs: [(e["op"], e["module"], e["nbytes"], e["phase"]) for e in evs]
    assert strip(events(run, "tp")) == strip(events(run, "tp_no_async"))
    assert strip(events(run, "sp")) == strip(events(run, "sp_no_async"))


@on_ranks(2, 4, devices=DEVICES)
def test_ffn_derivation_shards_concatenate_partials_sum_dx_allreduced_dw_local(ranks):
    run = recorded(ranks.device)
    """Column then row on p ranks (p=2: the 2-way derivation): the O_i = X A_i concatenate to O; the partial
    Y_i = GELU(O_i) B_i sum to Y and none alone is Y; the dO_i A_i sum to dX (the all-reduce) and none alone is
    dX; dA_i, dB_i are slices of dA, dB with no collective (the only one in backward is dX's all-reduce).
    Each rank asserted the tensor equalities (check_ffn_derivation, in recorded())."""
    assert run["ffn_backward_collectives"] == [("all_reduce", (S, B, H))]


@on_ranks(2, 4, devices=DEVICES)
def test_grad_accumulation_fusion_accumulates_into_main_grad(ranks):
    run = recorded(ranks.device)
    # main_grad equal to the plain model's grad: asserted in recorded()
    assert run["grad_accumulation_fusion"] == {"fc1_grad_is_none": True, "fc1_main_grad_dtype": "torch.float32"}


@on_ranks(2, 4, devices=DEVICES)
def test_dropout_masks_shared_on_replicas_and_independent_on_shards(ranks):
    run = recorded(ranks.device)
    dropout = run["dropout"]
    for sp in (False, True):
        assert dropout[f"sp={sp}"]["replicas_equal"], f"sp={sp}: TP replicas drifted apart"
        assert dropout[f"sp={sp}"]["eval_differs"], "dropout should be active in training mode"
    assert dropout["default_stream_kept"], "fork() must leave the default stream as it was"
    assert dropout["distinct_sharded_draws"] == ranks.world, "each TP rank should draw its own sharded mask"

"""Record one training step of a one-block TP transformer per configuration and dump every rank's log.

Usage: tp_claims_worker.py OUT_DIR. Writes OUT_DIR/<config>.rank<r>.json (CollectiveRecorder.to_dict() plus
the shapes), which test_tp_claims.py reads to check the notes' claims. Checks that are naturally per rank
(the explicit 2-way FFN derivation, main_grad accumulation) assert here and print a marker line.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from common import assert_close, gather_dim, init
from reference.parallel_state import build_layout
from reference.recorder import CollectiveRecorder
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.transformer import ParallelTransformer
from reference.tensor_parallel.unsharded import Transformer, init_method_normal

device = init()
out_dir = Path(sys.argv[1])
world, rank = dist.get_world_size(), dist.get_rank()
tp = build_layout(tp_size=world).tp_group
B, S, H, HEADS = 2, 8, 16, 4


def record_step(name, **kwargs):
    torch.manual_seed(0)
    model = ParallelTransformer(1, H, HEADS, tp_group=tp, device=device, **kwargs)
    x = torch.randn(S, B, H, device=device, requires_grad=True)
    with CollectiveRecorder() as rec:
        rec.watch(model)
        (model(x) ** 2).sum().backward()
    data = {**rec.to_dict(), "b": B, "s": S, "h": H, "dtype_size": x.element_size(), "tp": world}
    (out_dir / f"{name}.rank{rank}.json").write_text(json.dumps(data))


def check_ffn_derivation():
    """Y = GELU(X A) B with A split by columns, B by rows, spelled out (the 2-way derivation, on p ranks)."""
    torch.manual_seed(1)
    fc1 = ColumnParallelLinear(H, 4 * H, tp_group=tp, init_method=init_method_normal(), bias=False, device=device)
    fc2 = RowParallelLinear(4 * H, H, tp_group=tp, init_method=init_method_normal(), bias=False,
                            input_is_parallel=True, device=device)
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
    ops = [(e.op, e.shape) for e in rec.events]
    assert ops == [("all_reduce", (S, B, H))], ops


def check_grad_accumulation_fusion():
    """Two micro-batches accumulate into weight.main_grad; weight.grad is never materialized."""
    torch.manual_seed(2)
    model = ParallelTransformer(1, H, HEADS, tp_group=tp, gradient_accumulation_fusion=True, device=device)
    torch.manual_seed(2)
    plain = Transformer(1, H, HEADS, device=device)
    for _micro_batch in range(2):
        x = torch.randn(S, B, H, device=device)
        (model(x) ** 2).sum().backward()
        (plain(x) ** 2).sum().backward()
    fc1 = model.layers[0].mlp.fc1.weight
    assert fc1.grad is None and fc1.main_grad.dtype == torch.float32
    assert_close(gather_dim(fc1.main_grad, 0, tp), plain.layers[0].mlp.fc1.weight.grad, "fc1 main_grad")
    fc2 = model.layers[0].mlp.fc2.weight
    assert_close(gather_dim(fc2.main_grad, 1, tp), plain.layers[0].mlp.fc2.weight.grad, "fc2 main_grad")


def check_dropout_streams():
    """Replicated activations get the same mask on every TP rank, split ones an independent mask per rank."""
    get_state = torch.cuda.get_rng_state if device.type == "cuda" else torch.get_rng_state
    set_state = torch.cuda.set_rng_state if device.type == "cuda" else torch.set_rng_state
    for sp in (False, True):
        torch.manual_seed(3)
        model = ParallelTransformer(1, H, HEADS, tp_group=tp, sequence_parallel=sp, hidden_dropout=0.3,
                                    attention_dropout=0.3, dropout_seed=9, device=device)
        x = torch.randn(S, B, H, device=device)
        out = model(x).detach()
        replicas = gather_dim(out.unsqueeze(0), 0, tp)
        assert all(torch.equal(r, replicas[0]) for r in replicas), f"sp={sp}: TP replicas drifted apart"
        assert not torch.allclose(model.eval()(x), out), "dropout should be active in training mode"
    saved = get_state()
    with model.layers[0].rng.fork():
        sharded_draw = torch.rand(8, device=device)
    after_fork = torch.rand(8, device=device)
    set_state(saved)
    assert torch.equal(after_fork, torch.rand(8, device=device)), "fork() must leave the default stream as it was"
    draws = gather_dim(sharded_draw.unsqueeze(0), 0, tp)
    assert len({tuple(d.tolist()) for d in draws}) == world, "each TP rank should draw its own sharded mask"


record_step("tp")
record_step("sp", sequence_parallel=True)
record_step("tp_no_async", async_grad_allreduce=False)
record_step("sp_no_async", sequence_parallel=True, async_grad_allreduce=False)
check_ffn_derivation()
print(f"rank {rank}: FFN derivation ok", flush=True)
check_grad_accumulation_fusion()
print(f"rank {rank}: grad accumulation fusion ok", flush=True)
check_dropout_streams()
print(f"rank {rank}: dropout streams ok", flush=True)
dist.destroy_process_group()

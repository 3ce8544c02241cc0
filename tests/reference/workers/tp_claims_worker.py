"""Record one training step of a one-block TP transformer per configuration and dump every rank's log.

Usage: tp_claims_worker.py OUT_DIR. Each rank writes OUT_DIR/rank<r>.json: per configuration its
CollectiveRecorder.to_dict() plus the shapes, which test_tp_claims.py reads to check the notes' claims, and
what the per-rank checks (the explicit 2-way FFN derivation, main_grad accumulation, dropout streams)
observed; their tensor equalities assert here, naming the tensor.
"""

import torch
import torch.distributed as dist
from common import assert_close, gather_dim, serve

from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.parallelize import parallelize
from reference.tensor_parallel.transformer import Transformer, init_method_normal

B, S, H, HEADS = 2, 8, 16, 4


def record_step(tp, device, **kwargs) -> dict:
    torch.manual_seed(0)
    model = parallelize(Transformer(1, H, HEADS, device=device), tp, **kwargs)
    x = torch.randn(S, B, H, device=device, requires_grad=True)
    with CollectiveRecorder() as rec:
        rec.watch(model)
        (model(x) ** 2).sum().backward()
    return {**rec.to_dict(), "b": B, "s": S, "h": H, "dtype_size": x.element_size(), "tp": tp.size()}


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
    return [[e.op, e.shape] for e in rec.events]


def check_grad_accumulation_fusion(tp, device) -> dict:
    """Two micro-batches accumulate into weight.main_grad (equal to the plain model's grad); weight.grad is
    never materialized."""
    torch.manual_seed(2)
    model = parallelize(Transformer(1, H, HEADS, device=device), tp, gradient_accumulation_fusion=True)
    torch.manual_seed(2)
    plain = Transformer(1, H, HEADS, device=device)
    for _micro_batch in range(2):
        x = torch.randn(S, B, H, device=device)
        (model(x) ** 2).sum().backward()
        (plain(x) ** 2).sum().backward()
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
            Transformer(1, H, HEADS, hidden_dropout=0.3, attention_dropout=0.3, device=device),
            tp,
            sequence_parallel=sp,
            dropout_seed=9,
        )
        x = torch.randn(S, B, H, device=device)
        out = model(x).detach()
        replicas = gather_dim(out.unsqueeze(0), 0, tp)
        observed[f"sp={sp}"] = {
            "replicas_equal": all(torch.equal(r, replicas[0]) for r in replicas),
            "eval_differs": not torch.allclose(model.eval()(x), out),
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


def results(device: torch.device) -> dict:
    """Each configuration's recorded step, and what the per-rank checks observed."""
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


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()

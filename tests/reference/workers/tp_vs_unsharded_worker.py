"""The TP transformer against the plain one built from the same master weights, at any world size.

Every rank asserts outputs, input gradients, gradients and parameters equal (assert_close, naming the
configuration, step and tensor) and writes the configurations it compared, for test_tp_vs_unsharded.py."""

import itertools

import torch
import torch.distributed as dist
from common import assert_close, full_tensor, serve

from reference.parallel_state import build_layout
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads
from reference.tensor_parallel.parallelize import parallelize
from reference.tensor_parallel.transformer import Transformer

H, HEADS, LAYERS, B = 16, 4, 2, 2


def params_by_name(model):
    return {n: (n.rsplit(".", 1)[0], n.rsplit(".", 1)[1], p) for n, p in model.named_parameters()}


def compare_models(tp, device, sp, overlap, fusion, seq, pad) -> str:
    torch.manual_seed(1234)
    ref = parallelize(
        Transformer(LAYERS, H, HEADS, device=device),
        tp,
        sequence_parallel=sp,
        async_grad_allreduce=overlap,
        gradient_accumulation_fusion=fusion,
        pad_sequence=pad,
    )
    torch.manual_seed(1234)
    plain = Transformer(LAYERS, H, HEADS, device=device)
    with torch.no_grad():  # non-zero biases and LayerNorm affine, identical on both sides
        g = torch.Generator().manual_seed(7)
        for (mod, pname, p), q in zip(params_by_name(ref).values(), plain.parameters()):
            if pname == "bias" or "ln" in mod:
                q.add_(torch.randn(q.shape, generator=g).to(device) * 0.1)
                shard = q if not mod.endswith(("qkv", "fc1")) else q.chunk(tp.size())[tp.rank()]
                p.copy_(shard)
    ref_sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    plain_sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    what = f"sp={sp} overlap={overlap} fusion={fusion} seq={seq}"
    for step in range(3):
        torch.manual_seed(100 + step)
        x = torch.randn(seq, B, H, device=device)
        target = torch.randn(seq, B, H, device=device)
        x_ref, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out_plain = ref(x_ref), plain(x_plain)
        assert_close(out_ref, out_plain, f"{what} step {step} output")
        torch.nn.functional.mse_loss(out_ref, target).backward()
        torch.nn.functional.mse_loss(out_plain, target).backward()
        allreduce_sequence_parallel_grads(ref, tp)
        assert_close(x_ref.grad, x_plain.grad, f"{what} step {step} input grad")
        plain_params = dict(plain.named_parameters())
        for name, (mod, pname, p) in params_by_name(ref).items():
            grad = p.main_grad if hasattr(p, "main_grad") else p.grad  # gradient-accumulation fusion
            assert_close(full_tensor(mod, pname, grad, tp), plain_params[name].grad, f"{what} step {step} grad {name}")
        for p in ref.parameters():
            if hasattr(p, "main_grad"):
                p.grad = p.main_grad.to(p.dtype)  # what Megatron's optimizer reads
        ref_sgd.step(), plain_sgd.step()
        ref_sgd.zero_grad(), plain_sgd.zero_grad()
        for p in ref.parameters():
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
    for name, (mod, pname, p) in params_by_name(ref).items():
        assert_close(
            full_tensor(mod, pname, p.detach(), tp), plain_params[name].detach(), f"{what} param {name} after 3 steps"
        )
    return what


def results(device: torch.device) -> dict:
    """The configurations compared at this world size (every comparison asserted on the way)."""
    world = dist.get_world_size()
    tp = build_layout(tp_size=world).tp_group
    # every combination at world 2; at 1 and 4, four that still take each flag both ways
    configs = list(itertools.product([False, True], [True, False], [False, True]))
    if world != 2:
        configs = [(False, True, False), (True, True, True), (True, False, False), (False, False, True)]
    compared = [compare_models(tp, device, sp, overlap, fusion, seq=8, pad=False) for sp, overlap, fusion in configs]
    if world > 1:
        compared.append(compare_models(tp, device, True, True, False, seq=8 * world + 1, pad=True))
    return {"compared": compared}


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()

"""The TP GPT blocks equal the unsharded ones built from the same master weights (world sizes 1, 2, 4).

Outputs, input gradients and every weight gradient (re-assembled from the shards) match for 3 SGD steps,
with and without sequence parallelism, overlap and gradient-accumulation fusion, and with a padded sequence;
every rank asserts, naming the configuration, step and tensor.
"""

import itertools

import torch

from reference.gpt.model import gpt_blocks
from reference.parallel_state import build_layout
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads
from reference.tensor_parallel.parallelize import parallelize
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES
from tests.reference.helpers import assert_close, full_tensor

H, HEADS, LAYERS, B = 16, 4, 2, 2


def configurations(world: int) -> list[tuple[bool, bool, bool, int]]:
    """(sp, overlap, fusion, seq) compared at `world`: every flag combination at 2, four covering each flag both
    ways at 1 and 4, and (TP > 1) sequence parallelism with a padded sequence of 8 * world + 1."""
    flags = list(itertools.product([False, True], [True, False], [False, True]))
    if world != 2:
        flags = [(False, True, False), (True, True, True), (True, False, False), (False, False, True)]
    return [(*f, 8) for f in flags] + ([(True, True, False, 8 * world + 1)] if world > 1 else [])


def params_by_name(model):
    return {n: (n.rsplit(".", 1)[0], n.rsplit(".", 1)[1], p) for n, p in model.named_parameters()}


def compare_models(tp, device, sp, overlap, fusion, seq) -> None:
    torch.manual_seed(1234)
    ref = parallelize(
        gpt_blocks(LAYERS, H, HEADS, device=device),
        tp,
        sequence_parallel=sp,
        async_grad_allreduce=overlap,
        gradient_accumulation_fusion=fusion,
        pad_sequence=seq % tp.size() != 0,
    )
    torch.manual_seed(1234)
    plain = gpt_blocks(LAYERS, H, HEADS, device=device)
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
        out_ref, out_plain = ref(None, None, hidden=x_ref), plain(None, None, hidden=x_plain)
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


@on_ranks(1, 2, 4, devices=DEVICES)
def test_tp_transformer_matches_unsharded_for_several_steps(ranks):
    tp = build_layout(tp_size=ranks.world).tp_group
    for sp, overlap, fusion, seq in configurations(ranks.world):
        compare_models(tp, ranks.device, sp, overlap, fusion, seq)

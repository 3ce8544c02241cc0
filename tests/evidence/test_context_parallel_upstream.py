"""Upstream evidence for context parallelism, run here on CPU/gloo: torch's `_templated_ring_attention` and its
backward (the CPU flash-attention kernels as the per-block op), causal, head-tail balanced and not, against
unsharded SDPA and the reference ring; torch's head-tail balancer's indices and megatron-core's
`get_batch_on_this_cp_rank` split against the reference shard; megatron-core's distributed optimizer sharded over
dp x cp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

from benchmarks._torch_ring import cp_options, torch_ring_attention
from reference.context_parallel import ring_attention, ring_blocks, shard
from reference.measure.recorder import CollectiveRecorder
from reference.measure.torch_patches import cuda_calls_on_cpu
from tests.ranks import on_ranks
from tests.reference.helpers import megatron_parallel_state
from tests.reference.test_distributed_optimizer import CudaTypeNames


def _qkv(seq: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, seq, 8, generator=g) for _ in range(4)]


def _torch_ring(ranks, balanced: bool, rotate: str = "ALL_GATHER"):
    """torch's ring attention forward and backward on this rank's shards: (out, dq, dk, dv)."""
    q, k, v, grad = (shard(t, 2, ranks.rank, ranks.world, balanced) for t in _qkv())
    with cp_options(enable_load_balance=balanced, rotate_method=torch_cp._RotateMethod[rotate]):
        return torch_ring_attention(ranks.group, q, k, v, grad)


def _reference_ring(ranks, balanced: bool):
    local = [shard(t, 2, ranks.rank, ranks.world, balanced).requires_grad_() for t in _qkv()[:3]]
    out = ring_attention(*local, ranks.group, balanced)
    out.backward(shard(_qkv()[3], 2, ranks.rank, ranks.world, balanced))
    return out.detach(), *(t.grad for t in local)


def _unsharded(ranks, balanced: bool):
    q, k, v, grad = _qkv()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*whole, is_causal=True)
    out.backward(grad)
    return [shard(t, 2, ranks.rank, ranks.world, balanced) for t in (out.detach(), *(t.grad for t in whole))]


@pytest.mark.upstream("pytorch")
@on_ranks(2, 4)
@pytest.mark.parametrize("balanced", [True, False], ids=["head_tail", "contiguous"])
def test_torch_templated_ring_attention_equals_causal_sdpa_and_the_reference_ring(ranks, balanced):
    """Forward (out) and backward (dq, dk, dv): torch's ring equals unsharded SDPA and the reference ring."""
    theirs, ours, whole = _torch_ring(ranks, balanced), _reference_ring(ranks, balanced), _unsharded(ranks, balanced)
    for name, t, o, w in zip(("out", "dq", "dk", "dv"), theirs, ours, whole):
        torch.testing.assert_close(t, w, rtol=1e-5, atol=1e-5, msg=f"torch {name} vs SDPA")
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5, msg=f"reference {name} vs torch")


@pytest.mark.upstream("pytorch")
@on_ranks(2)
def test_torch_ring_attention_all_to_all_rotater_gives_the_same_result(ranks):
    """torch's two K/V rotaters (one all-gather up front, or a permute each step) compute the same attention."""
    gathered, rotated = _torch_ring(ranks, True, "ALL_GATHER"), _torch_ring(ranks, True, "ALL_TO_ALL")
    for a, b in zip(gathered, rotated):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_torch_head_tail_load_balancer_indices_equal_the_reference_cp_shard(cp):
    seq = 4 * cp
    indices = _HeadTailLoadBalancer(seq, cp, "cpu")._generate_indices()[0]
    ours = torch.cat([shard(torch.arange(seq), 0, r, cp) for r in range(cp)])
    assert indices.tolist() == ours.tolist()


@pytest.mark.upstream("megatron-lm")
@on_ranks(2, 4)
def test_megatron_get_batch_on_this_cp_rank_equals_the_reference_cp_shard(ranks):
    """megatron-core's split of a batch's tokens, labels and position ids over the cp group (here the world)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    seq = 8 * ranks.world
    tokens = torch.arange(3 * seq).view(3, seq)
    whole = {"tokens": tokens, "labels": tokens + 1, "position_ids": torch.arange(seq).expand(3, -1)}
    theirs = get_batch_on_this_cp_rank(dict(whole), cp_group=ranks.group)  # it replaces the dict's values
    assert theirs.keys() == whole.keys()
    for key, value in whole.items():
        assert torch.equal(theirs[key], shard(value, 1, ranks.rank, ranks.world)), key


@pytest.mark.upstream("pytorch")
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("balanced", [True, False], ids=["head_tail", "contiguous"])
def test_torch_is_causal_behavior_per_ring_step_matches_the_reference_cp_blocks(cp, balanced):
    """torch decides per (rank, step) whether to run the block causal, full or not at all; the reference's
    blocks of that step are then: some masked (step 0), all full or skipped, or all skipped."""
    with cp_options(enable_load_balance=balanced):
        for rank, steps in enumerate(ring_blocks(cp, balanced)):
            for step, blocks in enumerate(steps):
                behavior = torch_cp._is_causal_behavior(rank, cp, step, is_causal=True)
                kinds = {kind for _, _, kind in blocks}
                expected = {
                    torch_cp._CausalBehavior.IS_CAUSAL: "masked" in kinds,
                    torch_cp._CausalBehavior.NOT_IS_CAUSAL: "full" in kinds and "masked" not in kinds,
                    torch_cp._CausalBehavior.SKIP: kinds == {"skipped"},
                }[behavior]
                assert expected, (rank, step, behavior, blocks)


@pytest.mark.upstream("megatron-lm")
@on_ranks(2)
def test_megatron_cp_distributed_optimizer_shards_over_dp_times_cp(ranks):
    """megatron-core's distributed optimizer (get_megatron_optimizer) at CP 2 x DP 1 (world 2): built on the
    dp x cp group, each rank holds the fp32 masters of half the parameters, and a step reduce-scatters the
    gradients, all-reduces its found-inf flag and all-gathers the parameters over both ranks: what
    `--cp 2 --dp-sharding optimizer` does at dp 1."""
    from megatron.core.distributed import DistributedDataParallel as MegatronDDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    cuda_calls_on_cpu()  # megatron's buffers allocate on torch.cuda.current_device()
    torch.manual_seed(0)
    module = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with megatron_parallel_state(context_parallel_size=2), CudaTypeNames():
        config = TransformerConfig(
            num_layers=1, hidden_size=64, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
        )
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
        model = MegatronDDP(config, ddp, module)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=0.1, bf16=True, clip_grad=0.0, use_distributed_optimizer=True),
            [model],
            use_gloo_process_groups=False,
        )
        inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
        with CollectiveRecorder() as rec:
            (model(x.chunk(2)[ranks.rank]).float() ** 2).mean().backward()
            model.finish_grad_sync()
            optimizer.step()
        assert inner.data_parallel_group.size() == 2
        assert sum(m.numel() for group in inner.shard_fp32_from_float16_groups for m in group) == 64 * 64 // 2
    assert [(e.op, e.group_ranks) for e in rec.events] == [
        ("reduce_scatter", (0, 1)),
        ("all_reduce", (0, 1)),
        ("all_gather", (0, 1)),
    ]

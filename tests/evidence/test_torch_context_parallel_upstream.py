"""What the close reading of torch's context parallelism claims, shown on torch's own code (torch 2.13.0).

torch/distributed/tensor/experimental/_context_parallel/ runs on CPU/gloo: `_templated_ring_attention` and its
backward with, as `op`, the CPU flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`, which returns
the output and its log-sum-exp), the merger, the rotaters and the head-tail balancer. `context_parallel()`
itself runs only non-causal here, and not by the ring: the CPU flash op has no CP handler (nor a causal
sharding strategy: pytorch#147793), so DTensor gathers K and V. Shapes [batch, heads, sequence, head dim];
the sequence is dim 2, as torch hard-codes. A "chunk" is one of 2·cp equal slices of the sequence; under
head-tail balancing rank r holds chunks r and 2·cp−1−r. Megatron's reduction over DP × CP runs megatron-core
0.16.1's own DistributedDataParallel.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental._context_parallel import _attention as cp
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _create_default_load_balancer,
    _HeadTailLoadBalancer,
)

from benchmarks._torch_ring import FLASH, FLASH_BACKWARD, cp_options
from reference.context_parallel import load_balance
from reference.measure.recorder import CollectiveRecorder
from reference.measure.torch_patches import cuda_calls_on_cpu
from tests.ranks import on_ranks
from tests.reference.helpers import every_rank, megatron_parallel_state

pytestmark = pytest.mark.upstream("pytorch")

B, HEADS, S, D = 2, 2, 16, 8
F32 = 1e-6  # torch merges (and accumulates gradients) in float32 (`convert_to_f32`, default True), float64 here


def qkv(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The same full-sequence query, key and value on every rank (float64: differences are the algorithm's)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, HEADS, S, D, generator=g, dtype=torch.float64) for _ in range(3))


def head_tail(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s head-tail shard: chunks r and 2·world−1−r of 2·world, concatenated (Megatron's split; that
    it is torch's balancer's: test_torch_head_tail_load_balancer_indices_equal_the_reference_cp_shard)."""
    return load_balance.shard(t, 2, rank, world)


def contiguous_shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return load_balance.shard(t, 2, rank, world, balanced=False)


class RecordedOp:
    """The attention op, recording what each call computed: query and key lengths, the mask, contiguity."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, q, k, v, is_causal, **kwargs):
        contiguous = k.is_contiguous() and v.is_contiguous()
        self.calls.append({"q": q.shape[2], "k": k.shape[2], "is_causal": is_causal, "contiguous": contiguous})
        return FLASH(q, k, v, is_causal=is_causal, **kwargs)


def ring(shard, balanced: bool, rotate=cp._RotateMethod.ALL_GATHER, seed: int = 0):
    """torch's ring attention over this rank's shards; (out, lse, op calls, collectives, the full q, k, v)."""
    q, k, v = qkv(seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    op = RecordedOp()
    with cp_options(enable_load_balance=balanced, rotate_method=rotate), CollectiveRecorder() as rec:
        out, lse, *_ = cp._templated_ring_attention(
            dist.group.WORLD, 2, op, *(shard(t, rank, world) for t in (q, k, v)), is_causal=True
        )
    return out, lse, op.calls, rec.events, (q, k, v)


def full_causal(q, k, v):
    out, lse, *_ = FLASH(q, k, v, is_causal=True)
    return out, lse


@on_ranks(2, 4)
def test_ring_attention_balanced_causal_equals_full_causal_sdpa(ranks):
    """Head-tail shards, torch's default `enable_load_balance=True`: each rank's merged output and log-sum-exp
    are its rows of the full causal attention."""
    out, lse, _, _, (q, k, v) = ring(head_tail, balanced=True)
    full_out, full_lse = full_causal(q, k, v)
    torch.testing.assert_close(out, head_tail(full_out, ranks.rank, ranks.world), rtol=0, atol=F32)
    torch.testing.assert_close(lse, head_tail(full_lse, ranks.rank, ranks.world), rtol=0, atol=F32)


@on_ranks(2)
def test_ring_attention_unbalanced_causal_equals_full_causal_sdpa(ranks):
    """Contiguous shards with `enable_load_balance=False`: the same rows of the full causal attention."""
    out, lse, _, _, (q, k, v) = ring(contiguous_shard, balanced=False)
    full_out, full_lse = full_causal(q, k, v)
    torch.testing.assert_close(out, contiguous_shard(full_out, ranks.rank, ranks.world), rtol=0, atol=F32)
    torch.testing.assert_close(lse, contiguous_shard(full_lse, ranks.rank, ranks.world), rtol=0, atol=F32)


@on_ranks(2)
def test_ring_attention_masks_only_step_0_and_skips_or_halves_the_rest(ranks):
    """Step 0 (a rank's own K/V) is the only causal call. Unbalanced, a rank skips K/V from ranks after it
    and attends fully to those before: rank 0 idles at step 1. Balanced, every rank works every step on half
    the pairs: rank 0 its tail query chunk against both key chunks, rank 1 both query chunks against the
    head key chunk."""
    local = S // 2
    _, _, unbalanced, _, _ = ring(contiguous_shard, balanced=False)
    _, _, balanced, _, _ = ring(head_tail, balanced=True)
    strip = [[{k: c[k] for k in ("q", "k", "is_causal")} for c in calls] for calls in every_rank(unbalanced)]
    assert strip == [
        [{"q": local, "k": local, "is_causal": True}],  # rank 0: step 1 skipped
        [{"q": local, "k": local, "is_causal": True}, {"q": local, "k": local, "is_causal": False}],
    ]
    strip = [[{k: c[k] for k in ("q", "k", "is_causal")} for c in calls] for calls in every_rank(balanced)]
    assert strip == [
        [{"q": local, "k": local, "is_causal": True}, {"q": local // 2, "k": local, "is_causal": False}],
        [{"q": local, "k": local, "is_causal": True}, {"q": local, "k": local // 2, "is_causal": False}],
    ]
    behaviours = [[cp._is_causal_behavior(r, 2, i, True) for i in range(2)] for r in range(2)]
    with cp_options(enable_load_balance=False):
        unbalanced_behaviours = [[cp._is_causal_behavior(r, 2, i, True) for i in range(2)] for r in range(2)]
    B_ = cp._CausalBehavior
    assert behaviours == [[B_.IS_CAUSAL, B_.NOT_IS_CAUSAL], [B_.IS_CAUSAL, B_.NOT_IS_CAUSAL]]
    assert unbalanced_behaviours == [[B_.IS_CAUSAL, B_.SKIP], [B_.IS_CAUSAL, B_.NOT_IS_CAUSAL]]


def pairs_per_rank(world: int, seq: int, balanced: bool) -> list[int]:
    """(query, key) pairs a causal mask keeps, per rank, of the positions each rank's queries hold."""
    positions = torch.arange(seq)
    if balanced:
        positions = positions[_HeadTailLoadBalancer(seq, world, "cpu")._generate_indices()[0].long()]
    return [int((rows + 1).sum()) for rows in positions.chunk(world)]


def test_cp_head_tail_balancer_pairs_chunk_r_with_chunk_2cp_minus_1_minus_r():
    """`_HeadTailLoadBalancer`: 2·cp chunks, rank r's shard chunks r and 2·cp−1−r; restore indices invert it;
    the default balancer exists only when 2·cp divides the sequence. Balanced, the ranks' causal work is equal;
    contiguous, the last rank does nearly 3 times the first's at cp 2 (pairs 36 vs 100, sequence 16)."""
    assert _HeadTailLoadBalancer(16, 2, "cpu")._generate_indices()[0].tolist() == [
        *range(0, 4),
        *range(12, 16),
        *range(4, 8),
        *range(8, 12),
    ]
    assert _HeadTailLoadBalancer(8, 4, "cpu")._generate_indices()[0].tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    order = _HeadTailLoadBalancer(16, 2, "cpu")._generate_indices()[0]
    restore = _HeadTailLoadBalancer(16, 2, "cpu")._generate_indices(restore=True)[0]
    assert torch.equal(order[restore], torch.arange(16, dtype=order.dtype))
    with cp_options(enable_load_balance=True):
        assert isinstance(_create_default_load_balancer(16, 2, "cpu"), _HeadTailLoadBalancer)
        assert _create_default_load_balancer(18, 2, "cpu") is None
    with cp_options(enable_load_balance=False):
        assert _create_default_load_balancer(16, 2, "cpu") is None
    assert pairs_per_rank(2, 16, balanced=False) == [36, 100]
    assert pairs_per_rank(2, 16, balanced=True) == [68, 68]
    assert pairs_per_rank(4, 16, balanced=True) == [34, 34, 34, 34]


def test_cp_merger_combines_partial_attention_by_log_sum_exp():
    """`_SDPAMerger`: attention over keys A and then B, merged as out − sigmoid(lse_B − lse_A)·(out − out_B) and
    lse − logsigmoid(lse − lse_B), is attention over A ∪ B (lse: the log of the softmax denominator, per query);
    `partial=True` updates only the second half of the queries; a float32 accumulator, results in the input's
    dtype (`convert_to_f32`, default True)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.bfloat16) for _ in range(3))
    whole_out, whole_lse, *_ = FLASH(q.float(), k.float(), v.float())
    merger = cp._SDPAMerger(convert_to_f32=cp._cp_options.convert_to_f32, seq_dim=2)
    for keys in (slice(0, 3), slice(3, 8)):
        out, lse, *_ = FLASH(q, k[:, :, keys], v[:, :, keys])
        merger.step(out, lse, partial=False)
    out, lse = merger.results()
    assert cp._cp_options.convert_to_f32 is True and merger._out.dtype == torch.float32
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, whole_out.to(torch.bfloat16), rtol=0, atol=2e-2)
    torch.testing.assert_close(lse.float(), whole_lse, rtol=0, atol=2e-2)

    q, k, v = (t.double() for t in (q, k, v))
    merger = cp._SDPAMerger(convert_to_f32=False, seq_dim=2)
    first_out, first_lse, *_ = FLASH(q, k[:, :, :4], v[:, :, :4])
    merger.step(first_out, first_lse, partial=False)
    tail_out, tail_lse, *_ = FLASH(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:])
    merger.step(tail_out, tail_lse, partial=True)
    out, lse = merger.results()
    expected_tail, expected_tail_lse, *_ = FLASH(q[:, :, 4:], k, v)
    assert torch.equal(out[:, :, :4], first_out[:, :, :4]) and torch.equal(lse[:, :, :4], first_lse[:, :, :4])
    torch.testing.assert_close(out[:, :, 4:], expected_tail, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse[:, :, 4:], torch.logaddexp(first_lse[:, :, 4:], tail_lse), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse[:, :, 4:], expected_tail_lse, rtol=0, atol=1e-12)


def kv_bytes(world: int) -> int:
    """Bytes of one rank's K and V shards, float64."""
    return 2 * B * HEADS * (S // world) * D * 8


@on_ranks(2, 4)
def test_ring_attention_rotaters_all_gather_once_by_default_or_all_to_all_each_step(ranks):
    """torch's default `rotate_method` ALL_GATHER gathers every rank's flat K‖V once, before the first step,
    and slices rank (r − i)'s out at step i; ALL_TO_ALL passes the K‖V this rank holds to rank r + 1 at every
    step but the last (cp − 1 all-to-alls). Both give the same attention."""
    assert cp._cp_options.rotate_method == cp._RotateMethod.ALL_GATHER
    out_gather, _, _, gathered, _ = ring(head_tail, balanced=True)
    out_a2a, _, _, passed, _ = ring(head_tail, balanced=True, rotate=cp._RotateMethod.ALL_TO_ALL)
    group, world = tuple(range(ranks.world)), ranks.world
    assert [(e.op, e.group_ranks, e.shape, e.nbytes) for e in gathered] == [
        ("all_gather", group, (world * kv_bytes(world) // 8,), world * kv_bytes(world))
    ]
    assert [(e.op, e.group_ranks, e.shape) for e in passed] == [("all_to_all", group, (kv_bytes(world) // 8,))] * (
        world - 1
    )
    assert torch.equal(out_gather, out_a2a)


@on_ranks(2)
def test_ring_attention_sends_contiguous_key_value_as_one_flat_buffer(ranks):
    """K and V arrive as transposed views of [batch, sequence, heads, dim] (as an attention module makes them);
    torch makes them contiguous first (step 0's op sees them so), then moves K and V as one flattened
    concatenation, one collective of both, reshaped on arrival; balanced, rank 1's step 1 hands the op a
    view of the head key chunk, not contiguous: the op never required it."""
    q, k, v = qkv(1)
    r, w = ranks.rank, ranks.world
    as_views = [head_tail(t, r, w).transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not as_views[1].is_contiguous()
    op = RecordedOp()
    with cp_options(enable_load_balance=True, rotate_method=cp._RotateMethod.ALL_TO_ALL), CollectiveRecorder() as rec:
        out, *_ = cp._templated_ring_attention(dist.group.WORLD, 2, op, *as_views, is_causal=True)
    assert [c["contiguous"] for c in op.calls] == [True, r == 0]
    assert [(e.op, e.shape) for e in rec.events] == [("all_to_all", (kv_bytes(w) // 8,))]
    torch.testing.assert_close(out, head_tail(full_causal(q, k, v)[0], r, w), rtol=0, atol=F32)


@on_ranks(2)
def test_ring_attention_backward_balanced_equals_full_causal_gradients(ranks):
    """`_templated_ring_attention_backward` with the CPU flash backward: each rank's dq, dk, dv are its rows of
    the full causal attention's gradients; dK/dV travel by all-to-all once a step (cp of them, the last one
    carrying the finished gradients home), whatever `rotate_method` says, while K/V are all-gathered once."""
    r, w = ranks.rank, ranks.world
    q, k, v = (t.requires_grad_() for t in qkv(2))
    grad = torch.randn(B, HEADS, S, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    full_out, _ = full_causal(q, k, v)
    full_out.backward(grad)
    shards = [head_tail(t.detach(), r, w) for t in (q, k, v)]
    with cp_options(enable_load_balance=True):
        out, lse, *_ = cp._templated_ring_attention(dist.group.WORLD, 2, FLASH, *shards, is_causal=True)
        with CollectiveRecorder() as rec:
            dq, dk, dv, *_ = cp._templated_ring_attention_backward(
                dist.group.WORLD,
                2,
                FLASH_BACKWARD,
                head_tail(grad, r, w),
                "grad_out",
                *shards,
                out,
                lse,
                is_causal=True,
                dropout_p=0.0,
            )
    for mine, t in zip((dq, dk, dv), (q, k, v)):
        torch.testing.assert_close(mine, head_tail(t.grad, r, w), rtol=0, atol=F32)
    assert [e.op for e in rec.events] == ["all_gather", "all_to_all", "all_to_all"]


@on_ranks(2)
def test_context_parallel_non_causal_matches_sdpa(ranks):
    """`context_parallel()` shards q, k, v in place along dim 2, head-tail by default (contiguous with
    `enable_load_balance=False`), and SDPA inside it returns this rank's rows of the full non-causal attention.
    On the CPU it never reaches the ring: the CPU flash op has no CP handler, so DTensor all-gathers K and V
    (two all-gathers) and attends locally."""
    q, k, v = (t.float() for t in qkv(4))
    full = F.scaled_dot_product_attention(q, k, v)
    mesh = init_device_mesh("cpu", (ranks.world,))
    # DTensor finds the op's sharding by running its decomposition for every placement of q, k, v (about a
    # minute of CPU), once per shape: outside CommDebugMode, which would see each of those ops too
    warm = [t.clone() for t in (q, k, v)]
    with cp.context_parallel(mesh, buffers=warm, buffer_seq_dims=[2] * 3):
        F.scaled_dot_product_attention(*warm)
    for balanced, shard in ((True, head_tail), (False, contiguous_shard)):
        buffers = [t.clone() for t in (q, k, v)]
        with (
            cp_options(enable_load_balance=balanced),
            mock.patch.object(cp, "_templated_ring_attention", wraps=cp._templated_ring_attention) as ring_spy,
            cp.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 3),
            CommDebugMode() as comm,
        ):
            assert buffers[0].shape[2] == S // ranks.world
            out = F.scaled_dot_product_attention(*buffers)
        torch.testing.assert_close(out, shard(full, ranks.rank, ranks.world), rtol=1e-5, atol=1e-5)
        assert buffers[0].shape[2] == S  # restored on exit
        assert ring_spy.call_count == 0
        assert {str(op): n for op, n in comm.get_comm_counts().items()} == {"c10d_functional.all_gather_into_tensor": 2}


@on_ranks(2)
def test_megatron_cp_gradients_are_reduced_over_dp_times_cp(ranks):
    """megatron-core's DistributedDataParallel at CP 2 × DP 1 (world 2): the gradient buffer is all-reduced
    over the DP × CP group (both ranks), though the DP group is one rank, averaging (÷ DP·CP); the schedule
    multiplies a 2-output loss by the CP size first, so ranks that each hold half a sequence and return their
    half's sum over the whole count get the full sequence's mean gradient."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel as MegatronDDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
    from megatron.core.transformer import TransformerConfig

    cuda_calls_on_cpu()  # megatron's grad buffers allocate on torch.cuda.current_device()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(6))
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 1)
    (expected,) = torch.autograd.grad((module(x) ** 2).mean(), module.weight)
    with megatron_parallel_state(context_parallel_size=2):
        assert parallel_state.get_data_parallel_world_size() == 1
        assert parallel_state.get_data_parallel_world_size(with_context_parallel=True) == 2
        config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
        model = MegatronDDP(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
        mine = x.chunk(2)[ranks.rank]  # this rank's half of the sequence
        loss, _ = forward_step_calc_loss(
            model, model(mine), lambda out: ((out**2).sum() / len(x), None), config, None, False, 1, [], 2, True
        )
        with CollectiveRecorder() as rec:
            loss.backward()
            model.finish_grad_sync()
        weight = model.module.weight
        torch.testing.assert_close(weight.main_grad, expected, rtol=1e-6, atol=1e-7)
    assert [(e.op, e.group_ranks) for e in rec.events] == [("all_reduce", (0, 1))]


@on_ranks(2)
def test_megatron_cp_gradients_are_divided_by_the_token_count_not_dp_cp_under_per_token_loss(ranks):
    """The same CP 2 × DP 1 model with calculate_per_token_loss: DDP's gradient scaling factor is 1, not
    1/(DP·CP), and the schedule leaves a three-output loss a sum, so the all-reduce sums the two halves' gradients
    of their token sums; finalize_model_grads then sums the token counts over DP × CP and divides by them: the
    full sequence's mean gradient again, by the token count instead of by DP·CP."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel as MegatronDDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
    from megatron.core.transformer import TransformerConfig

    cuda_calls_on_cpu()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(6))
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 1)
    (mean,) = torch.autograd.grad((module(x) ** 2).mean(), module.weight)
    with megatron_parallel_state(context_parallel_size=2):
        config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, calculate_per_token_loss=True)
        model = MegatronDDP(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
        assert [b.gradient_scaling_factor for b in model.buffers] == [1.0]
        mine = x.chunk(2)[ranks.rank]  # this rank's half of the sequence: 4 tokens
        loss, tokens = forward_step_calc_loss(
            model,
            model(mine),
            lambda out: ((out**2).sum(), torch.tensor(len(mine)), None),
            config,
            None,
            False,
            1,
            [],
            2,
            True,
        )
        assert tokens.item() == len(mine)
        torch.testing.assert_close(loss.detach(), (module(mine) ** 2).sum().detach())  # the sum, not / its tokens
        loss.backward()
        with mock.patch.object(model, "scale_gradients", wraps=model.scale_gradients) as scale:
            finalize_model_grads([model], num_tokens=tokens.clone())  # reduces (finish_grad_sync), then divides
        assert [c.args for c in scale.call_args_list] == [(1.0 / len(x),)]  # the token count over DP × CP: 8
        torch.testing.assert_close(model.module.weight.main_grad, mean, rtol=1e-6, atol=1e-7)
        assert parallel_state.get_data_parallel_world_size(with_context_parallel=True) == 2

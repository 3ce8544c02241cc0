"""reference.context_parallel: each form of context-parallel attention (ring, all-gather, Ulysses all-to-all),
head-tail balanced and not, equals unsharded causal SDPA in its output and its q/k/v gradients; the shards and
the per-rank block counts that make the balance visible; Ulysses' head limit refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reference.context_parallel import (
    all_gather_attention,
    block_counts,
    blocks,
    positions,
    ring_attention,
    ring_blocks,
    shard,
    ulysses_attention,
    unshard,
)
from reference.parallel_state import ParallelConfigError
from tests.ranks import on_ranks

FORMS = {"ring": ring_attention, "all_gather": all_gather_attention, "ulysses": ulysses_attention}


def _qkv(seq: int, heads: int = 4, seed: int = 0):
    """q, k, v [2, heads, seq, 8] and an output gradient, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, seq, 8, generator=g, dtype=torch.float64) for _ in range(4)]


def _check_form(ranks, form: str, balanced: bool, seq: int = 16) -> None:
    """This rank's output and q/k/v gradients of the sharded form against its shard of the unsharded ones."""
    q, k, v, grad = _qkv(seq)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*whole, is_causal=True).backward(grad)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def mine(t):
        return shard(t, 2, ranks.rank, ranks.world, balanced)

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    out = FORMS[form](*local, ranks.group, balanced)
    out.backward(mine(grad))
    torch.testing.assert_close(out, mine(expected), rtol=1e-10, atol=1e-10)
    for got, full in zip(local, whole):
        torch.testing.assert_close(got.grad, mine(full.grad), rtol=1e-10, atol=1e-10)


@on_ranks(2, 4)
@pytest.mark.parametrize("balanced", [True, False], ids=["head_tail", "contiguous"])
def test_ring_attention_equals_causal_sdpa_and_its_gradients(ranks, balanced):
    _check_form(ranks, "ring", balanced)


@on_ranks(2, 4)
@pytest.mark.parametrize("balanced", [True, False], ids=["head_tail", "contiguous"])
def test_context_parallel_all_gather_equals_causal_sdpa_and_its_gradients(ranks, balanced):
    _check_form(ranks, "all_gather", balanced)


@on_ranks(2, 4)
@pytest.mark.parametrize("balanced", [True, False], ids=["head_tail", "contiguous"])
def test_context_parallel_ulysses_equals_causal_sdpa_and_its_gradients(ranks, balanced):
    _check_form(ranks, "ulysses", balanced)


@on_ranks(2)
def test_ring_attention_in_bf16_stays_close_to_fp32_sdpa(ranks):
    """bf16 in, fp32 accumulation inside (torch's convert_to_f32): within bf16's rounding of the fp32 result."""
    q, k, v, grad = (t.float() for t in _qkv(32))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    local = [shard(t, 2, ranks.rank, 2).bfloat16() for t in (q, k, v)]
    out = ring_attention(*local, ranks.group)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), shard(expected, 2, ranks.rank, 2), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cp_block_by_hand_equals_the_fused_kernel_forward_and_backward(dtype):
    """The formulas blocks.py teaches (and runs where the device has no fused kernel) against the CPU flash
    kernel the ring runs here, for the second query chunk's two blocks, the earlier keys (full) and its own
    (masked): the same (out, lse) and, from their merged (out, lse), the same (dq, dk, dv)."""
    q, k, v, grad = (t.to(dtype) for t in _qkv(8))
    queries, grad = q[:, :, 4:], grad[:, :, 4:]
    two_blocks = [(k[:, :, :4], v[:, :, :4], False), (k[:, :, 4:], v[:, :, 4:], True)]
    scale, tol = 8**-0.5, {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]
    merged = (torch.zeros_like(queries), torch.full_like(queries[..., :1], float("-inf")))
    for block in two_blocks:
        expected = blocks.by_hand(queries, *block, scale)
        torch.testing.assert_close(blocks.attend(queries, *block, scale), expected, rtol=tol, atol=tol)
        merged = blocks.merge(*merged, *expected)
    for key, value, masked in two_blocks:
        fused = blocks.attend_backward(queries, key, value, *merged, grad, masked, scale)
        by_hand = blocks.backward_by_hand(queries, key, value, *merged, grad, masked, scale)
        torch.testing.assert_close(fused, by_hand, rtol=tol, atol=tol)


@on_ranks(2)
def test_cp_ulysses_refuses_heads_that_cp_does_not_divide_in_one_line(ranks):
    q, k, v, _ = _qkv(8, heads=3)
    local = [shard(t, 2, ranks.rank, 2) for t in (q, k, v)]
    refusal = r"^Ulysses splits heads over cp: 3 attention heads do not divide by cp 2$"
    with pytest.raises(ParallelConfigError, match=refusal):
        ulysses_attention(*local, ranks.group)


def test_cp_head_tail_shard_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    tokens = torch.arange(16)
    assert [shard(tokens, 0, r, 4).tolist() for r in range(4)] == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]
    assert shard(tokens, 0, 1, 4, balanced=False).tolist() == [4, 5, 6, 7]
    for balanced in (True, False):
        shards = [shard(tokens, 0, r, 4, balanced) for r in range(4)]
        assert torch.equal(unshard(shards, 0, balanced), tokens)
    assert positions(8, 0, 2).tolist() == [0, 1, 6, 7]  # what rotary reads on rank 0 of cp 2


def test_cp_shard_refuses_a_sequence_that_2cp_does_not_divide_in_one_line():
    with pytest.raises(ParallelConfigError, match=r"^the sequence length \(12\) is not divisible by 2 x cp"):
        shard(torch.arange(12), 0, 0, 4)
    with pytest.raises(ParallelConfigError, match=r"^the sequence length \(6\) is not divisible by cp \(4\)$"):
        shard(torch.arange(6), 0, 0, 4, balanced=False)


def test_cp_without_balancing_the_first_rank_idles_in_block_counts():
    """cp 4, s/cp-token blocks: rank 0 computes its diagonal and skips 3 steps, rank 3 computes all 4."""
    assert block_counts(4, balanced=False) == [
        {"full": 0, "masked": 1, "skipped": 3},
        {"full": 1, "masked": 1, "skipped": 2},
        {"full": 2, "masked": 1, "skipped": 1},
        {"full": 3, "masked": 1, "skipped": 0},
    ]


def test_cp_head_tail_balancing_gives_every_rank_the_same_block_counts():
    """cp 4, s/(2 cp)-token blocks: 2 diagonals, 2 cp - 1 full and as many skipped on every rank, i.e. the
    whole causal triangle (2 cp (2 cp + 1) / 2 = 36 blocks, 8 diagonal) split evenly."""
    counts = block_counts(4, balanced=True)
    assert counts == [{"full": 7, "masked": 2, "skipped": 7}] * 4
    assert sum(c["full"] + c["masked"] for c in counts) == 8 * 9 // 2


def test_cp_ring_steps_follow_torch_is_causal_behavior_per_step():
    """Balanced, step 0 is the local causal attention; after it rank r computes, with source s = (r - i) mod cp,
    its two query chunks against the source's first chunk when s < r, its second query chunk against both when
    s > r: torch's three per-step cases."""
    steps = ring_blocks(2)[1]
    assert [(q, k) for q, k, kind in steps[0] if kind != "skipped"] == [(1, 1), (2, 1), (2, 2)]
    assert [(q, k) for q, k, kind in steps[1] if kind != "skipped"] == [(1, 0), (2, 0)]  # source 0 < rank 1
    assert [(q, k) for q, k, kind in ring_blocks(2)[0][1] if kind != "skipped"] == [(3, 1), (3, 2)]

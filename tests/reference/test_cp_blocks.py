"""reference.measure.cp_blocks: the blocks the ring attention's observer sees, read from the positions each ring
step actually holds, are the plan of reference.context_parallel.load_balance.ring_blocks; without balancing the
first rank attends the fewest query-key pairs, head-tail balanced every rank the same."""

from __future__ import annotations

import pytest

from reference.context_parallel import ring_blocks
from reference.measure.cp_blocks import record_run
from tests.ranks import on_ranks


@on_ranks(2, 4)
@pytest.mark.parametrize("balanced", [True, False], ids=["head_tail", "contiguous"])
def test_cp_ring_attention_observer_sees_the_planned_blocks(ranks, balanced):
    run = record_run(16, balanced)
    seen = [
        [[(b["query_chunk"], b["key_chunk"], b["kind"]) for b in st["blocks"]] for st in r["steps"]]
        for r in run["ranks"]
    ]
    assert seen == ring_blocks(ranks.world, balanced)


@on_ranks(4)
def test_cp_without_balancing_rank_0_attends_the_fewest_pairs_and_balanced_all_the_same(ranks):
    unbalanced, balanced = (record_run(16, b) for b in (False, True))
    c = 16 // ranks.world  # an unbalanced chunk: rank r attends its diagonal and r full blocks
    assert [r["pairs"] for r in unbalanced["ranks"]] == [c * (c + 1) // 2 + r * c * c for r in range(ranks.world)]
    assert [r["pairs"] for r in balanced["ranks"]] == [16 * 17 // 2 // ranks.world] * ranks.world

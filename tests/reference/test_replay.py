"""reference.measure.replay: the textbook orders replayed with per-action costs idle what pipeline algebra says,
on every stage: (p - 1) / (m + p - 1) when the stages are equal, and when the last stage is the heaviest (as
the LM head makes it), each stage r idles 1 - m c_r / (sum of c + (m - 1) max c), c_r its forward + backward."""

import pytest

from reference.measure.replay import idle_fraction, idle_fractions, replay
from tests.pipeline_orders import textbook


def orders(schedule: str, p: int, m: int) -> list[list[str]]:
    return [textbook(schedule, p, r, m) for r in range(p)]


def costs(orders: list[list[str]], forward: list[float]) -> list[list[float]]:
    """Each action's cost: stage r's forward costs forward[r], its backward twice that."""
    return [[f * (1 if a[0] == "F" else 2) for a in order] for order, f in zip(orders, forward)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 3), (4, 8), (4, 2)])
def test_equal_stages_idle_the_formula_on_every_stage(schedule, p, m):
    steps = orders(schedule, p, m)
    assert idle_fractions(replay(steps, costs(steps, [3.0] * p))) == pytest.approx([(p - 1) / (m + p - 1)] * p)
    assert idle_fraction(steps) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_heavier_last_stage_makes_the_others_wait_for_it(schedule):
    p, m, forward = 4, 8, [1.0, 1.0, 1.0, 1.5]
    steps = orders(schedule, p, m)
    per_micro_batch = [3 * f for f in forward]
    step = sum(per_micro_batch) + (m - 1) * max(per_micro_batch)
    expected = [1 - m * c / step for c in per_micro_batch]
    assert idle_fractions(replay(steps, costs(steps, forward))) == pytest.approx(expected)
    assert expected[0] > (p - 1) / (m + p - 1) > expected[-1]


def test_interleaved_chunks_of_equal_cost_idle_the_interleaved_formula():
    """p 2, v 2, m 2 by hand: stage r runs chunk c as virtual stage c p + r (Megatron's interleaved order)."""
    steps = [
        ["F0.0", "F0.1", "F1.0", "F1.1", "B1.0", "B1.1", "B0.0", "B0.1"],
        ["F0.0", "F0.1", "F1.0", "B1.0", "F1.1", "B1.1", "B0.0", "B0.1"],
    ]
    p, v, m = 2, 2, 2
    assert idle_fractions(replay(steps, costs(steps, [0.5, 0.5]), chunks=v)) == pytest.approx(
        [(p - 1) / (v * m + p - 1)] * p
    )


def test_orders_that_wait_on_each_other_are_refused():
    with pytest.raises(ValueError, match="wait on each other"):
        replay([["B0", "F0"], ["F0", "B0"]], [[2, 1], [1, 2]])

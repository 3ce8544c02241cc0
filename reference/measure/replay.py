"""Replay recorded pipeline action orders with uniform costs: the bubble a schedule's order has on uniform hardware.

Wall-clock bubbles of ranks sharing a few CPU cores are noise; the order each stage ran is not. Replaying the
orders with only their data dependencies and fixed costs gives the idle fraction to compare with a closed form
(tests/reference/test_interleaved.py, test_megatron_pipeline_upstream.py, benchmarks/bench_pipeline.py).
"""

from __future__ import annotations


def idle_fraction(orders: list[list[str]], chunks: int = 1, forward: float = 1.0, backward: float = 2.0) -> float:
    """Replay each stage's recorded order with uniform costs and only the data dependencies, and return the idle
    fraction of the step. Actions are F<i>/B<i>, or F<c>.<i>/B<c>.<i> for model chunk c of `chunks` per stage
    (virtual stage c * p + r, costing 1/chunks of a whole stage): F_i after F_i on the virtual stage before,
    B_i after F_i here and B_i on the virtual stage after."""
    p, done, clock, position = len(orders), {}, [0.0] * len(orders), [0] * len(orders)

    def parse(action: str, r: int) -> tuple[str, int, int]:
        chunk, _, mb = action[1:].rpartition(".")
        return action[0], int(chunk or 0) * p + r, int(mb)

    def needs(kind: str, k: int, mb: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", k - 1, mb)] if k > 0 else []
        return [("F", k, mb)] + ([("B", k + 1, mb)] if k < p * chunks - 1 else [])

    while any(position[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if position[r] == len(orders[r]):
                continue
            action = parse(orders[r][position[r]], r)
            if all(need in done for need in needs(*action)):
                start = max([clock[r]] + [done[need] for need in needs(*action)])
                clock[r] = done[action] = start + (forward if action[0] == "F" else backward) / chunks
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"the orders wait on each other (no stage can run its next action): {orders}")
    busy = sum(forward if a[0] == "F" else backward for a in orders[0]) / chunks
    return 1 - busy / max(clock)

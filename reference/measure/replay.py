"""Replay recorded pipeline action orders at given costs: the bubble a schedule's order has on modeled hardware.

Wall-clock bubbles of ranks sharing a few CPU cores are noise; the order each stage ran and the FLOPs of each
action are not. Replaying the orders with only their data dependencies (transfers free), each action costing
its recorded FLOPs at a stated rate or a uniform cost (reference/gpt/demo.py prints both; `idle_fraction`:
tests/reference/test_interleaved.py, test_megatron_pipeline_upstream.py, benchmarks/bench_pipeline.py), gives
each stage's idle fraction to compare with (p - 1) / (v m + p - 1), which assumes equal stages.
"""

from __future__ import annotations

from reference.pipeline.zero_bubble import v_stages


def replay(
    orders: list[list[str]], costs: list[list[float]], chunks: int = 1, v_shape: bool = False
) -> list[list[tuple[float, float]]]:
    """Each stage's actions as (start, end), each as early as the stage's previous action and its inputs allow.
    Actions are F<i>/B<i>, or F<c>.<i>/B<c>.<i> for model chunk c of `chunks` per stage (virtual stage c p + r,
    or with `v_shape` the V of reference.pipeline.zero_bubble.v_stages), and I/W, a backward split in two:
    F_i after F_i on the virtual stage before, B_i or I_i after F_i here and B_i or I_i on the virtual stage
    after, W_i after I_i here; orders[r][k] takes costs[r][k]."""
    p, done, clock, position = len(orders), {}, [0.0] * len(orders), [0] * len(orders)
    spans: list[list[tuple[float, float]]] = [[] for _ in orders]

    def parse(action: str, r: int) -> tuple[str, int, int]:
        chunk, _, mb = action[1:].rpartition(".")
        c = int(chunk or 0)
        stage = v_stages(p, r)[c] if v_shape else c * p + r
        return "B" if action[0] == "I" else action[0], stage, int(mb)  # I: what B is to the stage before

    def needs(kind: str, k: int, mb: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", k - 1, mb)] if k > 0 else []
        if kind == "W":
            return [("B", k, mb)]
        return [("F", k, mb)] + ([("B", k + 1, mb)] if k < p * chunks - 1 else [])

    while any(position[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if position[r] == len(orders[r]):
                continue
            action = parse(orders[r][position[r]], r)
            if all(need in done for need in needs(*action)):
                start = max([clock[r]] + [done[need] for need in needs(*action)])
                clock[r] = done[action] = start + costs[r][position[r]]
                spans[r].append((start, clock[r]))
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"the orders wait on each other (no stage can run its next action): {orders}")
    return spans


def idle_fractions(spans: list[list[tuple[float, float]]]) -> list[float]:
    """Each stage's idle fraction of a replayed step: 1 - the time it computed / the whole step's."""
    step = max(end for stage in spans for _, end in stage)
    return [1 - sum(end - start for start, end in stage) / step for stage in spans]


def uniform_costs(orders: list[list[str]], chunks: int = 1, forward: float = 1.0, backward: float = 2.0):
    """Every stage equal: each forward `forward`, each backward `backward` (its I and its W half of it each: at
    the defaults F = I = W), a chunk's action 1/chunks of those."""
    cost = {"F": forward, "B": backward, "I": backward / 2, "W": backward / 2}
    return [[cost[a[0]] / chunks for a in order] for order in orders]


def idle_fraction(
    orders: list[list[str]], chunks: int = 1, forward: float = 1.0, backward: float = 2.0, v_shape: bool = False
) -> float:
    """The idle fraction under uniform costs: the same on every stage, since every stage computes as long."""
    return idle_fractions(replay(orders, uniform_costs(orders, chunks, forward, backward), chunks, v_shape))[0]

"""Zero-bubble schedules as lists of actions per rank: ZB-H1, ZB-V and DualPipeV.

A backward splits in two (reference.pipeline.steps.Steps.backward_input / backward_weight): I, the gradient
of the stage's input, which the stage before waits for, and W, the weight gradients, which nobody waits for
and which can fill the idle slots. An action is (kind, stage, micro-batch) with kind F (forward), I, W or B
(the two in one), stage the global stage index; DualPipeV also runs an Overlap of a forward and a full
backward of two different micro-batches, the pair whose communication DeepSeek-V3 hides behind compute.

  ZB-H1     one stage per rank, 1F1B's warm-up; rank r runs each W r micro-batches late (the later ranks
            send their input gradients upstream sooner) and the W's left fill the cool-down: 1F1B's
            activations in flight, a third of its bubble time.
  ZB-V      two stages per rank laid out in a V (rank r holds stages r and 2p - 1 - r, so the first and the
            last stage are on rank 0 and the turn of the V is local to rank p - 1).
  DualPipeV the same V, micro-batches from the front overlapped with backwards from the back; m >= 2p.

Each order mirrors the per-rank order (idle slots dropped) of torch's own schedule objects, which
tests/evidence/test_zero_bubble_orders_upstream.py builds and compares:
`pytorch:torch/distributed/pipelining/schedules.py::ScheduleInterleavedZeroBubble` at one stage per rank,
`pytorch:torch/distributed/pipelining/schedules.py::ScheduleZBVZeroBubble` and
`pytorch:torch/distributed/pipelining/schedules.py::ScheduleDualPipeV`. The executor is
reference.pipeline.zero_bubble_run.
"""

from __future__ import annotations

from typing import NamedTuple

from reference.parallel_state import ParallelConfigError

ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank, in a V


class Action(NamedTuple):
    kind: str  # "F", "I" (input gradient), "W" (weight gradient) or "B" (both)
    stage: int  # global stage index
    micro_batch: int

    def __str__(self) -> str:  # torch's spelling: 3I1 is stage 3's input gradient of micro-batch 1
        return f"{self.stage}{self.kind}{self.micro_batch}"


class Overlap(NamedTuple):
    """A forward and another micro-batch's full backward, run back to back (DualPipeV's F;B)."""

    forward: Action
    backward: Action

    def __str__(self) -> str:
        return f"({self.forward};{self.backward})"


def v_stages(p: int, r: int) -> tuple[int, int]:
    """The two stages rank r holds in a V of 2p stages: r on the way down, 2p - 1 - r on the way back."""
    return r, 2 * p - 1 - r


def stages_of(schedule: str, p: int, r: int) -> tuple[int, ...]:
    """The global stages rank r holds, in the order of its model chunks."""
    return v_stages(p, r) if schedule in V_SCHEDULES else (r,)


def check_zero_bubble(schedule: str, p: int, m: int | None = None, num_layers: int | None = None) -> None:
    """One-line refusals: a V needs two ranks and layers that cut into 2p equal stages; DualPipeV needs
    m >= 2p micro-batches (torch's ScheduleDualPipeV raises the same). None: not checked."""
    if schedule not in V_SCHEDULES:
        return
    if p < 2:
        raise ParallelConfigError(f"--schedule {schedule} lays two stages per rank in a V: it needs --pp >= 2, got {p}")
    if num_layers is not None and num_layers % (2 * p):
        raise ParallelConfigError(
            f"--schedule {schedule} cuts the model into a V of 2 x pp {p} = {2 * p} equal stages: "
            f"{num_layers} layers do not split; use a multiple of {2 * p} layers"
        )
    if schedule == "dualpipev" and m is not None and m < 2 * p:
        raise ParallelConfigError(
            f"--schedule dualpipev needs at least 2 x pp = {2 * p} micro-batches (one per stage of the V), got {m}"
        )


def v_layers(num_layers: int, p: int, r: int) -> list[tuple[int, int]]:
    """[first, last) layers of rank r's two V stages (checked by check_zero_bubble)."""
    per_stage = num_layers // (2 * p)
    return [(s * per_stage, (s + 1) * per_stage) for s in v_stages(p, r)]


def zb_h1_order(p: int, r: int, m: int) -> list[Action]:
    """1F1B's min(p - 1 - r, m) warm-up forwards; then per micro-batch k: the next forward, I(k), and W(k - r)
    once k >= r; the deferred W's last.

    Mirrors `pytorch:torch/distributed/pipelining/schedules.py::_get_1f1b_rank_ops` with enable_zero_bubble,
    one stage per rank and `num_1f1b_microbatches = rank`.
    """
    warmup = min(p - 1 - r, m)
    order = [Action("F", r, i) for i in range(warmup)]
    for k in range(m):
        if warmup + k < m:
            order.append(Action("F", r, warmup + k))
        order.append(Action("I", r, k))
        if k >= r:
            order.append(Action("W", r, k - r))
    return order + [Action("W", r, k) for k in range(max(m - r, 0), m)]


class _Counters:
    """The next micro-batch of each (kind, stage), and the I's whose W has not been placed (oldest first)."""

    def __init__(self):
        self.next: dict[tuple[str, int], int] = {}
        self.pending_w: list[Action] = []

    def count(self, kind: str, stage: int) -> int:
        return self.next.get((kind, stage), 0)

    def take(self, kind: str, stage: int) -> Action:
        i = self.count(kind, stage)
        self.next[(kind, stage)] = i + 1
        return Action(kind, stage, i)

    def input_grad(self, stage: int) -> Action:
        """I on `stage`; its W goes on the pending queue."""
        action = self.take("I", stage)
        self.pending_w.append(Action("W", stage, action.micro_batch))
        return action

    def full_backward(self, stage: int) -> Action:
        """B on `stage`: it takes the I counter's next micro-batch (I and B share one numbering)."""
        return Action("B", stage, self.take("I", stage).micro_batch)

    def oldest_w(self) -> list[Action]:
        return [self.pending_w.pop(0)] if self.pending_w else []


def zbv_order(p: int, r: int, m: int) -> list[Action]:
    """ZB-V on rank r (stages r and 2p - 1 - r): 2(p - r) - 1 forwards down, r pairs of forwards, p - r forwards
    back each followed by its I and W; then F I W down and F I W back in turn; then r pairs of I's, p - r I W
    down, and the W's left (back, then down). Planned for max(m, 2p - 1) micro-batches, the extra ones dropped,
    as torch does.

    Mirrors
    `pytorch:torch/distributed/pipelining/schedules.py::ScheduleZBVZeroBubble._calculate_single_rank_operations`.
    """
    down, back = v_stages(p, r)
    n, c = max(2 * p - 1, m), _Counters()

    def input_and_weight(stage: int) -> list[Action]:
        return [c.take("I", stage), c.take("W", stage)]

    order = [c.take("F", down) for _ in range(2 * (p - r) - 1)]
    for _ in range(r):
        order += [c.take("F", back), c.take("F", down)]
    for _ in range(p - r):
        order += [c.take("F", back), *input_and_weight(back)]
    while c.count("F", back) < c.count("F", down) or c.count("F", down) < n:
        if c.count("F", down) < n:
            order.append(c.take("F", down))
        order += [*input_and_weight(down), c.take("F", back), *input_and_weight(back)]
    for _ in range(r):
        order += [c.take("I", down), c.take("I", back)]
    for _ in range(p - r):
        order += [c.take("I", down), c.take("W", down)]
    for stage in (back, down):
        order += [c.take("W", stage) for _ in range(c.count("I", stage) - c.count("W", stage))]
    return [a for a in order if a.micro_batch < m]


def dualpipev_order(p: int, r: int, m: int) -> list[Action | Overlap]:
    """DualPipeV on rank r: forwards down, pairs of forwards, I W F on the way back, then the main phase of
    overlapped F;B pairs, then the full and the split backwards of the cool-down, the W's last.

    Mirrors `pytorch:torch/distributed/pipelining/schedules.py::ScheduleDualPipeV._calculate_single_rank_operations`.
    """
    check_zero_bubble("dualpipev", p, m)
    down, back = v_stages(p, r)
    c, order = _Counters(), []
    order += [c.take("F", down) for _ in range(2 * (p - r - 1))]
    for _ in range(r + 1):
        order += [c.take("F", down), c.take("F", back)]
    for _ in range(p - r - 1):
        order += [c.input_grad(back), *c.oldest_w(), c.take("F", back)]
    for k in range(m - 2 * p + r + 1):
        if k == 0 and r == p - 1:  # the last rank's first pair is not overlapped: a shorter bubble
            order += [c.take("F", down), c.full_backward(back)]
        else:
            order.append(Overlap(c.take("F", down), c.full_backward(back)))
        order.append(Overlap(c.take("F", back), c.full_backward(down)))
    for _ in range(p - r - 1):
        order += [c.full_backward(back), Overlap(c.take("F", back), c.full_backward(down))]
    split = False  # the second half of the cool-down splits its backwards, odd ranks one step earlier
    for k in range(r + 1):
        split = split or (k == (r + 1) // 2 and r % 2 == 1)
        order.append(c.input_grad(back) if split else c.full_backward(back))
        split = split or (k == (r + 1) // 2 and r % 2 == 0)
        order.append(c.input_grad(down) if split else c.full_backward(down))
    for _ in range(p - r - 1):
        order += [*c.oldest_w(), c.input_grad(down) if split else c.full_backward(down)]
    for _ in range(r + 1):
        order += c.oldest_w()
    return order


ORDERS = {"zb-h1": zb_h1_order, "zbv": zbv_order, "dualpipev": dualpipev_order}


def bubble_formula(schedule: str, p: int, m: int) -> float:
    """The idle fraction with a stage's F, I and W equal (1 each, so 3m of work per rank and micro-batches):
    ZB-H1 idles p - 1, a third of 1F1B's 3 (p - 1): (p - 1) / (3m + p - 1); in a V (ZB-V, and DualPipeV with
    its F;B run one after the other) a rank idles only the warm-up's p - 1 half-stage forwards:
    (p - 1) / (6m + p - 1). reference.measure.replay replays the orders to these values."""
    return (p - 1) / (3 * m + p - 1) if schedule == "zb-h1" else (p - 1) / (6 * m + p - 1)


def peak_in_flight(schedule: str, p: int, r: int, m: int) -> int:
    """Forwards (chunk-forwards in a V) whose I or B has not run, at most, on rank r, as its order implies: ZB-H1
    1F1B's min(p - r, m); ZB-V 2p on every rank once m >= 2p - 1 (each half a stage: rank 0's 1F1B peak, on
    every rank); DualPipeV 2p + 1, the overlapped forward before its pair's backward frees one."""
    held = peak = 0
    for action in flat(rank_order(schedule, p, r, m)):
        held += {"F": 1, "I": -1, "B": -1}.get(action.kind, 0)
        peak = max(peak, held)
    return peak


def rank_order(schedule: str, p: int, r: int, m: int) -> list[Action | Overlap]:
    return ORDERS[schedule](p, r, m)


def flat(order: list[Action | Overlap]) -> list[Action]:
    """The order with each Overlap's forward and backward in turn (how they run on one stream)."""
    return [a for item in order for a in (item if isinstance(item, Overlap) else (item,))]

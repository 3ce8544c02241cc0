"""TP x PP x DP training of the GPT against the unsharded model, for both schedules and several layouts.

Every rank asserts: the loss curve and its final weights equal the single-process UnshardedGPT's from the
same seed and data, each stage ran the textbook action order, and the peak number of micro-batches in
flight (counted by the schedule and measured from autograd's saved tensors) is GPipe's m and 1F1B's
min(pp - stage, m). With dp > 1 it reports when the DP all-reduces were issued against the last backward's
start and end (the recorder and the schedule share perf_counter()). Each rank writes OUT/rank<r>.json with
one entry per run, for the test to cross-check. Usage: pipeline_worker.py OUT (4 ranks).
"""

import torch
import torch.distributed as dist
from common import assert_close, full_stage_parameters, groups_of_the_block, serve, unsharded_gpt_training

from reference.gpt.model import GPTConfig, split_layers
from reference.gpt.parallelize import build_stage
from reference.gpt.train import data_parallel, split_batch, synthetic_batches, train_step
from reference.measure.pipeline_meter import PipelineMeter
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import ParallelConfigError, build_layout
from reference.pipeline.schedules import forward_backward
from tests.pipeline_orders import textbook

CONFIG = GPTConfig(vocab_size=51, hidden_size=16, num_attention_heads=4, num_layers=4, seq_length=8)
SEED, STEPS, LR = 1234, 3, 0.5
BUCKET_SIZE = 4096  # bytes: several DP buckets per stage, so their all-reduces overlap the last backward
# (tp, pp, dp, sequence_parallel, micro-batches) on 4 ranks, micro-batch size 1; world 8 (tp2 pp2 dp2) is
# covered by tests/reference/test_gpt_demo.py
LAYOUTS = [(1, 4, 1, False, 6), (1, 4, 1, False, 2), (2, 2, 1, True, 4), (1, 2, 2, False, 3), (2, 1, 2, False, 2)]


@groups_of_the_block()  # each layout's groups go with it
def run(device, tp, pp, dp, sp, m, schedule) -> dict:
    layout = build_layout(tp, pp, dp)
    what = f"tp{tp} pp{pp} dp{dp} sp={sp} m={m} {schedule}"
    stage = build_stage(CONFIG, layout, sequence_parallel=sp, seed=SEED, device=device)
    model = data_parallel(stage, layout, bucket_size=BUCKET_SIZE)  # several buckets: overlap in the 3D step
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    expected_losses, _, expected_weights = unsharded_gpt_training(CONFIG, SEED, STEPS, LR, dp * m)
    losses, results = [], []
    recorder = CollectiveRecorder()
    for tokens in synthetic_batches(CONFIG, STEPS, dp * m, SEED):
        recorder.clear()
        results.append(PipelineMeter(device))
        loss = train_step(
            model,
            optimizer,
            tokens,
            layout,
            num_micro_batches=m,
            schedule=schedule,
            device=device,
            record=recorder,
            observer=results[-1],
        )
        losses.append(loss)
    assert_close(torch.tensor(losses), torch.tensor(expected_losses), f"{what} losses", atol=2e-6, rtol=0)
    weight_diff = 0.0
    for name, full in full_stage_parameters(stage, layout.tp_group, CONFIG.vocab_size).items():
        expected = expected_weights[name]
        assert_close(full, expected, f"{what} final {name}", atol=2e-6, rtol=1e-5)
        weight_diff = max(weight_diff, (full - expected).abs().max().item())
    r = layout.pp_rank
    for result in results:
        assert result.actions == textbook(schedule, pp, r, m), (what, r, result.actions)
        peak = 1 if pp == 1 else (m if schedule == "gpipe" else min(pp - r, m))
        assert result.peak_in_flight == result.peak_in_flight_measured == peak, (what, r, result)
    last = results[-1]
    dp_ranks = tuple(dist.get_process_group_ranks(layout.dp_group))
    dp_starts = [e.start for e in recorder.events if e.op == "all_reduce" and e.group_ranks == dp_ranks]
    last_backward = last.action_spans[-1]
    assert last.actions[-1].startswith("B"), last.actions
    return {
        "layout": [tp, pp, dp],
        "sp": sp,
        "m": m,
        "schedule": schedule,
        "rank": dist.get_rank(),
        "pp_rank": r,
        "actions": last.actions,
        "peak": last.peak_in_flight_measured,
        "peak_activation_bytes": last.peak_activation_bytes,
        "bubble": last.bubble,
        "bubble_formula": last.bubble_formula,
        "dp_allreduces": len(dp_starts) if dp > 1 else 0,
        "dp_allreduces_before_last_backward": sum(t < last_backward[0] for t in dp_starts) if dp > 1 else 0,
        "dp_allreduces_during_last_backward": sum(last_backward[0] <= t < last_backward[1] for t in dp_starts)
        if dp > 1
        else 0,
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses, expected_losses)),
        "max_weight_diff": weight_diff,
    }


def bad_input() -> None:
    """Refused before any communication, with one-line errors."""
    cases = [
        (lambda: split_layers(2, 4), "4 pipeline stages need at least 4 transformer layers, the model has 2"),
        (
            lambda: split_batch(torch.zeros(10, 9, dtype=torch.long), 2, 0, 3),
            "a global batch of 10 sequences does not split into dp 2 x 3 micro-batches",
        ),
        (lambda: GPTConfig(hidden_size=10, num_attention_heads=4), "hidden_size (10) is not divisible"),
        (
            lambda: forward_backward("zero-bubble", None, [()], pp_group=None, activation_shape=()),
            "unknown pipeline schedule 'zero-bubble'",
        ),
        (lambda: forward_backward("1f1b", None, [], pp_group=None, activation_shape=()), "at least one micro-batch"),
    ]
    for fn, message in cases:
        try:
            fn()
        except ParallelConfigError as error:
            assert message in str(error) and "\n" not in str(error), (message, str(error))
        else:
            raise AssertionError(f"no error for: {message}")


def results(device: torch.device) -> dict:
    """Every layout and schedule's run on this rank (each asserted against the unsharded model)."""
    assert dist.get_world_size() == 4, "run on 4 ranks"
    bad_input()
    runs = [run(device, tp, pp, dp, sp, m, schedule) for tp, pp, dp, sp, m in LAYOUTS for schedule in ("gpipe", "1f1b")]
    return {"runs": runs}


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()

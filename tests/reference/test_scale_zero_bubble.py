"""The zero-bubble schedules at scale: `python -m reference.measure.scale --schedule zb-h1 | zbv | dualpipev` traces
one rank's step of the reference's schedule (fake process group, meta weights) and every row, the bytes held and the
peak of forwards in flight equal the closed forms of reference.measure.scale.formulas; here also against numbers
written out from the sizes. ZB-H1 moves 1F1B's tensors in another order; a V (ZB-V, DualPipeV) puts two stages on
each rank, the first and the last on rank 0, and sends nothing across its turn."""

from __future__ import annotations

import dataclasses
import json

import pytest

from reference.measure.scale import formulas
from reference.measure.scale.__main__ import main
from reference.measure.scale.shapes import MODELS, ScaleSetup
from reference.measure.scale.simulate import default_ranks, document, stage_of, step_of, summarize, trace_rank
from reference.parallel_state import Mesh

EIGHT = dataclasses.replace(MODELS["small"], name="small8", num_layers=8)  # a V of 8 stages at pp 4
M = 8


def setup(schedule: str, **layout) -> ScaleSetup:
    return ScaleSetup(EIGHT, microbatches=layout.pop("microbatches", M), schedule=schedule, **layout)


def every_stage(s: ScaleSetup) -> list[int]:
    return [int(rank) for rank in Mesh(s.tp, s.pp, s.dp).grid[:, 0, 0]]


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev"])
@pytest.mark.parametrize(
    "layout", [dict(tp=2, pp=4, dp=1), dict(tp=2, pp=2, dp=2, sp=True, bucket_size=20_000)], ids=["pp4", "sp-dp2"]
)
def test_zero_bubble_rows_held_bytes_and_peaks_equal_the_formulas_on_every_stage(schedule, layout):
    s = setup(schedule, **layout)
    doc = document(s, [step_of(s, rank) for rank in every_stage(s)])
    assert doc["agree"], [r for run in doc["runs"] for r in run["rows"] if r["count"] != r["formula_count"]]
    for run in doc["runs"]:
        assert run["pipeline"]["measured"] == run["pipeline"]["formula"], run["pipeline"]
        assert run["pipeline"]["bubble_formula"] == formulas.bubble(s)


def test_zb_h1_moves_the_tensors_of_1f1b_in_another_order():
    s = setup("zb-h1", tp=2, pp=4, dp=1)
    for rank in every_stage(s):
        ours, theirs = (trace_rank(dataclasses.replace(s, schedule=name), rank) for name in ("zb-h1", "1f1b"))
        assert sorted((e.key(), e.module) for e in ours) == sorted((e.key(), e.module) for e in theirs)


def test_a_v_in_numbers():
    """pp 4, m 8, 8 layers: rank r holds stages r and 7 - r, one layer each. Rank 0 (stages 0 and 7) sends m
    activations (stage 0 on) and m input grads (stage 7 back), and embeds and computes the loss, the rows of both
    ends of the model; an inner rank sends 2m of each, rank 3 (the turn, stages 3 and 4) again m: 3 -> 4 is local."""
    s = setup("zbv", tp=2, pp=4, dp=1)
    a = EIGHT.micro_batch_size * EIGHT.seq_length * EIGHT.hidden_size * 2  # one bf16 activation
    loss = EIGHT.micro_batch_size * EIGHT.seq_length * 4
    sends = {}
    for rank in every_stage(s):
        rows = {(r.group, r.op): (r.count, r.nbytes) for r in summarize(s, rank, trace_rank(s, rank))}
        sends[stage_of(s, rank)] = rows[("pp", "send")]
        assert rows[("pp", "recv")] == rows[("pp", "send")]
        if stage_of(s, rank) == 0:  # 2 layers x 4 per micro-batch, embedding, LM head input grad; the loss's 3
            assert rows[("tp", "all_reduce")] == (M * (8 + 2 + 3), M * (10 * a + 3 * loss))
        else:
            assert rows[("tp", "all_reduce")] == (M * 8, M * 8 * a)
    assert sends == {0: (2 * M, 2 * M * a), 1: (4 * M, 4 * M * a), 2: (4 * M, 4 * M * a), 3: (2 * M, 2 * M * a)}


def test_peaks_and_bubbles_in_numbers():
    """In flight at the peak: ZB-H1 1F1B's min(p - r, m), ZB-V 2p chunk-forwards on every rank (each half a
    stage), DualPipeV 2p + 1; bubbles with F = I = W: (p - 1) / (3m + p - 1) and in a V (p - 1) / (6m + p - 1)."""
    p = 4
    expected = {"zb-h1": [4, 3, 2, 1], "zbv": [8] * p, "dualpipev": [9] * p, "1f1b": [4, 3, 2, 1]}
    for schedule, peaks in expected.items():
        s = setup(schedule, tp=1, pp=p, dp=1)
        assert [formulas.pipeline(s, r)["peak_in_flight"] for r in range(p)] == peaks, schedule
    assert formulas.bubble(setup("zb-h1", tp=1, pp=p, dp=1)) == 3 / (3 * M + 3)
    assert formulas.bubble(setup("zbv", tp=1, pp=p, dp=1)) == formulas.bubble(setup("dualpipev", tp=1, pp=p, dp=1))
    assert formulas.bubble(setup("zbv", tp=1, pp=p, dp=1)) == 3 / (6 * M + 3)
    assert formulas.bubble(setup("1f1b", tp=1, pp=p, dp=1)) == 3 / (M + 3)


def test_the_cli_takes_the_zero_bubble_schedules_and_refuses_in_one_line(capsys):
    argv = ["--model", "small", "--tp", "2", "--pp", "2", "--dp", "1", "--micro-batches", "4"]
    assert main([*argv, "--schedule", "zbv", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["agree"] and doc["setup"]["schedule"] == "zbv"
    assert [run["pipeline"]["measured"]["peak_in_flight"] for run in doc["runs"]] == [4, 4]
    assert main([*argv, "--schedule", "dualpipev", "--rank", "0"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 5 chunk-forwards in flight at the peak (formula 5)" in out and "MISMATCH" not in out
    for extra, message in (
        (["--schedule", "zbv", "--pp", "4"], "4 layers do not split; use a multiple of 8 layers"),
        (["--schedule", "dualpipev", "--micro-batches", "3"], "needs at least 2 x pp = 4 micro-batches"),
    ):
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_default_ranks_of_a_v_are_its_first_middle_and_last_rank():
    s = setup("zbv", tp=2, pp=4, dp=2)
    assert [stage_of(s, rank) for rank in default_ranks(s)] == [0, 2, 3]

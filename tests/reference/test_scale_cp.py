"""The CP rows of the scale CLI: one layer's ring attention traced on the meta device over the fake process
group (reference.measure.scale.cp_report) sends and saves exactly the closed forms of
reference.measure.scale.formulas.cp_rows, at small cp and at the Llama-3-405B-like long-context layout (TP 8 x
CP 16 x PP 16, 128K tokens), whose numbers are also written out here from the sizes; a shifted formula shows the
comparison can fail; bad input is one line."""

from __future__ import annotations

import dataclasses
import json

import pytest

from reference.measure.scale import cp_report, formulas
from reference.measure.scale.__main__ import main
from reference.measure.scale.shapes import cp_setup_for


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("tp", [1, 2])
def test_cp_ring_traced_sends_and_saves_equal_the_closed_form(cp, tp):
    doc = cp_report.document(cp_setup_for("small", tp=tp, cp=cp))
    assert doc["agree"], doc["rows"]
    rows = {r["what"]: r for r in doc["rows"]}
    assert rows["forward sends"]["count"] == cp - 1 and rows["backward sends"]["count"] == cp


def test_cp_405b_long_context_layout_in_numbers(capsys):
    """n = 1 x 128/8 heads x 131072/16 tokens x d 128 = 2^24 bf16 elements per shard."""
    assert main("--model 405b --tp 8 --cp 16 --pp 16 --dp 1 --json".split()) == 0
    doc = json.loads(capsys.readouterr().out)
    n = 2**24
    assert doc["world"] == 2048 and doc["shard_shape"] == [1, 16, 8192, 128]
    rows = {r["what"]: (r["count"], r["bytes"]) for r in doc["rows"]}
    assert rows == {
        "K/V per ring step": (1, 2 * n * 2),  # 64 MiB
        "forward sends": (15, 15 * 2 * n * 2),
        "backward sends": (16, 15 * 4 * n * 4 + 2 * n * 4),
        "saved activations": (5, 3 * n * 2 + 4 * n + 4 * n // 128),
    }
    assert doc["stage_layers"] == 8 and doc["ring_bytes_per_stage"] == 8 * doc["ring_bytes_per_layer"]


def test_cp_rows_disagree_with_a_wrong_formula(monkeypatch):
    """Negative control: a formula off by one step is reported as a mismatch, exit 1."""
    right = formulas.cp_rows

    def off_by_one(setup):
        return {**right(setup), "forward sends": dataclasses.replace(right(setup)["forward sends"], count=setup.cp)}

    monkeypatch.setattr(formulas, "cp_rows", off_by_one)
    assert main("--model small --tp 1 --cp 2 --pp 1 --dp 1".split()) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--model small --tp 1 --cp 3 --pp 1 --dp 1", "is not divisible by 2 x cp (6 chunks, head-tail balanced)"),
        ("--model small --tp 3 --cp 2 --pp 1 --dp 1", "num_attention_heads"),
        ("--model small --tp 1 --cp 2 --pp 1 --dp 1 --sequence-parallel", "not modelled with --cp"),
    ],
)
def test_cp_scale_refuses_bad_input_in_one_line(capsys, argv, message):
    assert main(argv.split()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("rank", [0, 3])
def test_cp_ring_trace_on_real_tensors_equals_the_meta_trace(rank):
    setup = cp_setup_for("small", tp=2, cp=4)
    assert cp_report.trace(setup, rank, device="cpu") == cp_report.trace(setup, rank)

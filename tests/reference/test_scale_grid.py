"""The Scale page's calculator grid (reading_notes/traces/layout_grid.json, `python -m reference.measure.scale.grid`)
holds what `python -m reference.measure.scale` gives for every layout it offers.

Read the committed file as the page does (reference.measure.scale.grid.lookup, which the page's script mirrors):
every combination of its values equals reference.measure.scale.formulas run on the whole setup (so a table
keyed by too few settings fails), or the reference's refusal of that setup; the CLI's traced runs (the fake
process group: a small model here, the committed 70B traces) equal it row by row and byte by byte.
"""

from __future__ import annotations

import itertools
import json

import pytest

from reference.gpt.model import split_layers
from reference.measure.scale import formulas, grid
from reference.measure.scale.__main__ import main
from reference.measure.scale.shapes import cp_setup_for
from reference.measure.scale.simulate import GROUPS, default_ranks, stage_of
from reference.parallel_state import ParallelConfigError
from reference.pipeline.schedules import bubble_formula
from tests.launch import ROOT

TRACES = ROOT / "reading_notes" / "traces"


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads((TRACES / "layout_grid.json").read_text())


@pytest.mark.freshness
def test_committed_grid_is_what_the_grid_module_writes_now(committed):
    fresh = json.loads(json.dumps(grid.document()))
    assert fresh == committed, "reading_notes/traces/layout_grid.json is stale: re-record with tools/record-traces"


def cli_rows(setup, stage: int) -> list[list]:
    """formulas.expected for the whole setup as the CLI orders its rows: [group, op, count, bytes]."""
    expected = formulas.expected(setup, stage)
    order = sorted(expected, key=lambda k: (GROUPS.index(k[0]), k[1]))
    return [[group, op, *formulas.totals(expected[(group, op)])] for group, op in order]


def test_every_layout_of_the_grid_equals_the_formulas_on_the_whole_setup(committed):
    values = committed["values"]
    assert len(list(itertools.product(*values.values()))) == 7840
    shown = refused = 0
    for combination in itertools.product(*values.values()):
        setting = dict(zip(values, combination))
        found = grid.lookup(committed, setting)
        try:
            setup = grid.setup_of(setting)
        except ParallelConfigError as error:
            assert found == str(error), setting
            refused += 1
            continue
        ranks = default_ranks(setup)
        assert [(s["stage"], s["rank"]) for s in found["stages"]] == [(stage_of(setup, r), r) for r in ranks]
        for s in found["stages"]:
            assert s["rows"] == cli_rows(setup, s["stage"]), (setting, s["stage"])
            assert s["held"] == formulas.memory(setup, s["stage"]), (setting, s["stage"])
        assert found["bubble"] == bubble_formula(setup.pp, setup.microbatches)
        shown += 1
    # the small preset has 4 layers (no PP 8 or 16); the distributed optimizer needs dp > 1
    assert (shown, refused) == (5824, 2016)


def assert_grid_holds_the_trace(committed: dict, doc: dict, setting: dict) -> None:
    """Each traced rank's measured rows and held bytes (the CLI's JSON) are the grid's for `setting`."""
    found = grid.lookup(committed, setting)
    assert doc["agree"] and len(doc["runs"]) == len(found["stages"])
    for run, stage in zip(doc["runs"], found["stages"], strict=True):
        assert (run["stage"], run["rank"]) == (stage["stage"], stage["rank"])
        assert [[r["group"], r["op"], r["count"], r["bytes"]] for r in run["rows"]] == stage["rows"]
        assert run["memory"]["measured"] == stage["held"]


@pytest.mark.parametrize(
    "argv",
    [
        "--model small --tp 2 --pp 4 --dp 2 --micro-batches 4 --sequence-parallel --dp-sharding optimizer",
        "--model small --tp 4 --pp 2 --dp 8 --micro-batches 2",
    ],
    ids=["sp-distopt", "ddp"],
)
def test_the_cli_traces_what_the_grid_holds(committed, capsys, argv):
    """`python -m reference.measure.scale ... --json` traces a first, middle and last stage rank with the fake
    backend on meta tensors: what they issued and held is what the calculator shows for that layout."""
    assert main([*argv.split(), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    s = doc["setup"]
    setting = {
        "model": "small",
        **{k: s[k] for k in ("tp", "pp", "dp", "microbatches")},
        "sp": int(s["sp"]),
        "distributed_optimizer": int(s["distributed_optimizer"]),
    }
    assert_grid_holds_the_trace(committed, doc, setting)


@pytest.mark.parametrize(
    "name, sp, distopt", [("scale_70b", 0, 0), ("scale_70b_sp", 1, 0), ("scale_70b_distopt", 0, 1)]
)
def test_the_committed_70b_traces_are_what_the_grid_holds(committed, name, sp, distopt):
    """The page's own 70B traces (tools/record-traces; tests/reference/test_scale.py traces them afresh) are
    the calculator's initial layout and its two switches."""
    doc = json.loads((TRACES / f"{name}.json").read_text())
    setting = {**committed["initial"], "sp": sp, "distributed_optimizer": distopt}
    assert {k: doc["setup"][k] for k in ("tp", "pp", "dp", "microbatches")} == {
        k: setting[k] for k in ("tp", "pp", "dp", "microbatches")
    }
    assert_grid_holds_the_trace(committed, doc, setting)


def test_every_cp_layout_of_the_grid_equals_the_cp_rows_formulas(committed):
    """The calculator at CP > 1: every (model, TP, CP, PP) entry is formulas.cp_rows of that setup, and its
    stage totals, or the reference's refusal of it; the switches the CP rows leave out get the CLI's refusal."""
    table = committed["cp"]
    shown = refused = 0
    for model, tp, cp, pp in itertools.product(
        [*committed["values"]["model"], *table["models"]],
        committed["values"]["tp"],
        table["values"],
        committed["values"]["pp"],
    ):
        setting = {"model": model, "tp": tp, "cp": cp, "pp": pp, "dp": 1, "sp": 0, "distributed_optimizer": 0}
        found = grid.cp_lookup(committed, setting)
        try:
            setup = cp_setup_for(model, tp=tp, cp=cp, pp=pp)
        except ParallelConfigError as error:
            assert found == str(error), setting
            refused += 1
            continue
        rows = formulas.cp_rows(setup)
        assert found["rows"] == [[what, t.count, t.nbytes, t.formula] for what, t in rows.items()], setting
        layers = stage_layers(setup)
        per_layer = rows["forward sends"].nbytes + rows["backward sends"].nbytes
        assert (found["stage_layers"], found["ring_bytes_per_stage"]) == (layers, layers * per_layer), setting
        assert found["saved_bytes_per_stage"] == layers * rows["saved activations"].nbytes, setting
        shown += 1
    # the small preset has 4 layers (no PP 8 or 16)
    assert (shown, refused) == (260, 40)
    for switch in ("sp", "distributed_optimizer"):
        assert grid.cp_lookup(committed, {**setting, switch: 1}) == table["refusals"][switch]


def stage_layers(setup) -> int:
    first, last = split_layers(setup.model.num_layers, setup.pp)[0]
    return last - first


@pytest.mark.parametrize(
    "argv, refusal",
    [
        ("--model small --tp 2 --cp 4 --pp 2 --dp 1", None),
        ("--model 405b --tp 8 --cp 16 --pp 16 --dp 1", None),
        ("--model small --tp 2 --cp 4 --pp 2 --dp 1 --sequence-parallel", "sp"),
        ("--model 70b --tp 8 --pp 8 --dp 1 --cp 2 --dp-sharding optimizer", "distributed_optimizer"),
    ],
    ids=["small", "405b", "sp-refused", "distopt-refused"],
)
def test_the_cp_cli_traces_what_the_cp_grid_holds(committed, capsys, argv, refusal):
    """`python -m reference.measure.scale --cp N --json` traces one cp rank's ring attention on meta tensors: its
    measured rows and stage totals are what the calculator shows for that layout, and what it refuses, the
    calculator refuses in the same words."""
    code = main([*argv.split(), "--json"])
    out, err = capsys.readouterr()
    if refusal:
        assert code == 2 and err == f"reference.measure.scale: error: {committed['cp']['refusals'][refusal]}\n"
        return
    doc = json.loads(out)
    assert code == 0 and doc["agree"]
    found = grid.cp_lookup(committed, {**doc["setup"], "sp": 0, "distributed_optimizer": 0})
    assert [[r["what"], r["count"], r["bytes"], r["formula"]] for r in doc["rows"]] == found["rows"]
    for total in ("stage_layers", "ring_bytes_per_layer", "ring_bytes_per_stage", "saved_bytes_per_stage"):
        assert doc[total] == found[total], total


def test_a_model_only_the_cp_rows_trace_is_refused_at_cp_1_as_the_cli_refuses_it(committed, capsys):
    setting = {**committed["initial"], "model": "405b"}
    assert main(["--model", "405b", "--tp", "8", "--pp", "8", "--dp", "1"]) == 2
    assert capsys.readouterr().err == f"reference.measure.scale: error: {grid.lookup(committed, setting)}\n"

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

from reference.measure.scale import formulas, grid
from reference.measure.scale.__main__ import main
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
    assert len(list(itertools.product(*values.values()))) == 12544
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
    # the small preset has 4 layers (no PP 8); the distributed optimizer needs dp > 1; each 70B preset (the GPT
    # shape, Llama 3 70B and 405B) shows 2,912 layouts and refuses 224, the small one 2,184 and 952
    assert (shown, refused) == (3 * 2912 + 2184, 3 * 224 + 952)


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
    "name, sp, distopt",
    [("scale_70b", 0, 0), ("scale_70b_sp", 1, 0), ("scale_70b_distopt", 0, 1), ("scale_llama3_70b", 0, 0)],
)
def test_the_committed_70b_traces_are_what_the_grid_holds(committed, name, sp, distopt):
    """The page's own 70B traces (tools/record-traces; tests/reference/test_scale.py traces them afresh) are
    the calculator's initial layout and its two switches, and Llama-3-70B on the same layout."""
    doc = json.loads((TRACES / f"{name}.json").read_text())
    model = doc["setup"]["model"]["name"]
    setting = {**committed["initial"], "model": model, "sp": sp, "distributed_optimizer": distopt}
    assert {k: doc["setup"][k] for k in ("tp", "pp", "dp", "microbatches")} == {
        k: setting[k] for k in ("tp", "pp", "dp", "microbatches")
    }
    assert_grid_holds_the_trace(committed, doc, setting)

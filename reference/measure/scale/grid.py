"""`python -m reference.measure.scale.grid`: the closed forms of formulas.py over a grid of layouts, as JSON,
for the Scale page's calculator (tools/record-traces writes reading_notes/traces/layout_grid.json; the site,
which never imports the reference, looks the numbers up).

For each model, TP, PP, DP, micro-batch count, sequence parallelism and distributed optimizer in VALUES, and
each stage `python -m reference.measure.scale` traces by default: the (group, collective) rows of
formulas.expected, the bytes of formulas.memory, and bubble_formula; the rest is the CLI's default. Three
tables, each keyed by what its numbers depend on (TRAFFIC_BY, STATE_BY, BUBBLE_BY), not 6,272 layouts; an
entry is the reference's one-line refusal where a layout cannot exist. A fourth, "cp", holds what
`--cp N` prints (reference.measure.scale.cp_report): formulas.cp_rows of one layer's ring attention on a cp rank
and the totals over its stage's layers, for each model, TP, CP in CP_VALUES and PP (CP_BY), and the CLI's
refusals of the flags the CP rows leave out. tests/reference/test_scale_grid.py checks every layout against
formulas.py on the whole setup, so a dependence a key leaves out fails there.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys

from reference.arguments import OneLineParser
from reference.gpt.model import split_layers
from reference.measure.scale import cp_report, formulas
from reference.measure.scale.__main__ import build_parser
from reference.measure.scale.shapes import CP_MODELS, MODELS, CPSetup, ScaleSetup, cp_setup_for, setup_for
from reference.measure.scale.simulate import GROUPS, default_ranks, stage_of
from reference.parallel_state import ParallelConfigError
from reference.pipeline.schedules import bubble_formula

VALUES = {
    "model": list(MODELS),
    "tp": [1, 2, 4, 8],
    "pp": [1, 2, 4, 8, 16],
    "dp": [1, 2, 4, 8, 16, 32, 64],
    "microbatches": [1, 2, 4, 8, 16, 32, 64],
    "sp": [0, 1],
    "distributed_optimizer": [0, 1],
}
TRAFFIC_BY = ("model", "tp", "pp", "sp", "microbatches")
STATE_BY = ("model", "tp", "pp", "dp", "distributed_optimizer")
BUBBLE_BY = ("pp", "microbatches")
HELD = ("parameters", "gradients", "master_weights", "optimizer_states")  # formulas.memory's keys, in order
# Where a table leaves a setting free, it is set to one that never refuses on its own.
NEUTRAL = {"dp": 1, "distributed_optimizer": 0, "microbatches": 1, "sp": 0}
CP_VALUES = [1, 2, 4, 8, 16]
CP_BY = ("model", "tp", "cp", "pp")
CP_SWITCHES = {"sp": "--sequence-parallel", "distributed_optimizer": "--dp-sharding optimizer"}  # cp_report refuses


def key(by: tuple[str, ...], setting: dict) -> str:
    """A table's key for `setting`: its "by" values joined with "/" ("70b/8/8/0/16"); the page builds the same."""
    return "/".join(str(setting[name]) for name in by)


def setup_of(setting: dict) -> ScaleSetup:
    """The ScaleSetup `python -m reference.measure.scale` builds for this setting (the CLI's other defaults);
    ParallelConfigError where it cannot exist."""
    return setup_for(
        setting["model"],
        tp=setting["tp"],
        pp=setting["pp"],
        dp=setting["dp"],
        microbatches=setting["microbatches"],
        sp=bool(setting["sp"]),
        distributed_optimizer=bool(setting["distributed_optimizer"]),
    )


def rows(setup: ScaleSetup, stage: int, groups: tuple[str, ...]) -> list[list]:
    """[group, op, count, bytes] of formulas.expected for `groups`, in the CLI's row order (group, then op)."""
    expected = formulas.expected(setup, stage)
    return [
        [group, op, *formulas.totals(expected[(group, op)])]
        for group, op in sorted(expected, key=lambda k: (GROUPS.index(k[0]), k[1]))
        if group in groups
    ]


def traffic_entry(setup: ScaleSetup) -> list[dict]:
    return [
        {"stage": stage_of(setup, rank), "rows": rows(setup, stage_of(setup, rank), ("tp", "pp"))}
        for rank in default_ranks(setup)
    ]


def state_entry(setup: ScaleSetup) -> list[dict]:
    entry = []
    for rank in default_ranks(setup):
        stage = stage_of(setup, rank)
        held = formulas.memory(setup, stage)
        entry.append(
            {"stage": stage, "rank": rank, "held": [held[k] for k in HELD], "rows": rows(setup, stage, ("dp",))}
        )
    return entry


def table(by: tuple[str, ...], entry) -> dict:
    """{"by": by, "entries": {key: entry(setup) or the refusal}} over the VALUES of `by`."""
    entries = {}
    for values in itertools.product(*(VALUES[name] for name in by)):
        setting = {**NEUTRAL, **dict(zip(by, values))}
        try:
            entries[key(by, setting)] = entry(setup_of(setting))
        except ParallelConfigError as error:
            entries[key(by, setting)] = str(error)
    return {"by": list(by), "entries": entries}


def cp_setup_of(setting: dict) -> CPSetup:
    """The CPSetup `python -m reference.measure.scale --cp N` builds for this setting; ParallelConfigError where it
    cannot exist."""
    return cp_setup_for(setting["model"], tp=setting["tp"], cp=setting["cp"], pp=setting["pp"], dp=setting["dp"])


def cp_entry(setup: CPSetup) -> dict:
    """formulas.cp_rows as [what, count, bytes, formula], and what cp_report.document totals over the stage."""
    rows = formulas.cp_rows(setup)
    first, last = split_layers(setup.model.num_layers, setup.pp)[0]
    layers = last - first
    per_layer = rows["forward sends"].nbytes + rows["backward sends"].nbytes
    return {
        "rows": [[what, term.count, term.nbytes, term.formula] for what, term in rows.items()],
        "stage_layers": layers,
        "ring_bytes_per_layer": per_layer,
        "ring_bytes_per_stage": layers * per_layer,
        "saved_bytes_per_stage": layers * rows["saved activations"].nbytes,
    }


def cp_table() -> dict:
    """{"values", "initial", "by", "models" (CP_MODELS' shapes: the dense ones are the document's), "entries" {key:
    cp_entry or the refusal}, "refusals" {switch: the CLI's line}, "dense_refusals" {CP-only model: the dense
    CLI's line}}."""
    entries = {}
    choices = {**VALUES, "model": [*MODELS, *CP_MODELS], "cp": CP_VALUES}
    for values in itertools.product(*(choices[name] for name in CP_BY)):
        setting = {**NEUTRAL, **dict(zip(CP_BY, values))}
        try:
            entries[key(CP_BY, setting)] = cp_entry(cp_setup_of(setting))
        except ParallelConfigError as error:
            entries[key(CP_BY, setting)] = str(error)
    refusals = {}
    for switch, flags in CP_SWITCHES.items():
        try:
            cp_report.setup_from(build_parser().parse_args(["--cp", "2", *flags.split()]))
        except ParallelConfigError as error:
            refusals[switch] = str(error)
    dense_refusals = {}
    for model in CP_MODELS:
        try:
            setup_of({**NEUTRAL, "model": model, "tp": 1, "pp": 1})
        except ParallelConfigError as error:
            dense_refusals[model] = str(error)
    return {
        "values": CP_VALUES,
        "initial": build_parser().parse_args([]).cp,
        "by": list(CP_BY),
        "models": {name: dataclasses.asdict(CP_MODELS[name]) for name in CP_MODELS},
        "entries": entries,
        "refusals": refusals,
        "dense_refusals": dense_refusals,
    }


def document() -> dict:
    defaults = build_parser().parse_args([])
    initial = {
        "model": defaults.model,
        "tp": defaults.tp,
        "pp": defaults.pp,
        "dp": defaults.dp,
        "microbatches": defaults.micro_batches,
        "sp": int(defaults.sequence_parallel),
        "distributed_optimizer": int(defaults.dp_sharding == "optimizer"),
    }
    bubble = {
        key(BUBBLE_BY, {"pp": p, "microbatches": m}): bubble_formula(p, m)
        for p, m in itertools.product(VALUES["pp"], VALUES["microbatches"])
    }
    return {
        "kind": "layout_grid",
        "values": VALUES,
        "initial": initial,
        "fixed": {"schedule": defaults.schedule, "bucket_size": defaults.bucket_size, "order": defaults.order},
        "models": {name: dataclasses.asdict(shape) for name, shape in MODELS.items()},
        "held": list(HELD),
        "traffic": table(TRAFFIC_BY, traffic_entry),
        "state": table(STATE_BY, state_entry),
        "bubble": {"by": list(BUBBLE_BY), "entries": bubble},
        "cp": cp_table(),
    }


def lookup(doc: dict, setting: dict) -> str | dict:
    """What the page shows for `setting` (docs/javascripts/scale_calculator.js reads the document the same way):
    the reference's refusal, or {"stages": [{stage, rank, held {what: bytes}, rows [[group, op, count, bytes]]}],
    "bubble": fraction}, the rows in the CLI's order (the traffic table's TP and PP rows, then the state's DP)."""
    if setting["model"] in doc["cp"]["dense_refusals"]:  # a model the CP rows alone trace
        return doc["cp"]["dense_refusals"][setting["model"]]
    tables = [doc[name] for name in ("traffic", "state", "bubble")]
    traffic, state, bubble = (t["entries"][key(t["by"], setting)] for t in tables)
    for entry in (traffic, state):
        if isinstance(entry, str):
            return entry
    stages = []
    for moved, held in zip(traffic, state, strict=True):
        if moved["stage"] != held["stage"]:
            raise ValueError(f"{key(STATE_BY, setting)}: stage {moved['stage']} != {held['stage']}")
        stages.append(
            {
                "stage": held["stage"],
                "rank": held["rank"],
                "held": dict(zip(doc["held"], held["held"], strict=True)),
                "rows": moved["rows"] + held["rows"],
            }
        )
    return {"stages": stages, "bubble": bubble}


def cp_lookup(doc: dict, setting: dict) -> str | dict:
    """What the page shows for `setting` at cp > 1 (docs/javascripts/scale_calculator.js reads it the same way):
    the CLI's refusal of a switch the CP rows leave out or of the setup, or its cp_entry."""
    table = doc["cp"]
    for switch in CP_SWITCHES:
        if int(setting[switch]):
            return table["refusals"][switch]
    return table["entries"][key(table["by"], setting)]


def main(argv: list[str] | None = None) -> int:
    OneLineParser(prog="python -m reference.measure.scale.grid", description=__doc__.split("\n\n")[0]).parse_args(argv)
    json.dump(document(), sys.stdout, separators=(",", ":"))
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

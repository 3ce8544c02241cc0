"""`torchrun -m reference --fsdp`: per-step collective schedule, the last step's compute and collectives in issue
order (where each prefetch option moves the all-gathers), per-rank parameter memory, and the `--use-torch-fsdp`
swap printing the same schedule from PyTorch's FSDP1."""

from __future__ import annotations

import json

import pytest

from tests.ranks import on_ranks
from tests.reference.helpers import demo_output, json_lines, shared_tmp_dir

FLAGS = (
    "--fsdp",
    "--json",
    "--steps",
    "2",
    "--forward-prefetch",
    "--backward-prefetch",
    "pre",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--batch-size",
    "4",
)


@on_ranks(2)
def test_demo_json_reports_schedule_memory_and_matches_use_torch_fsdp(ranks):
    """Both demo runs on the two ranks; every rank asserts on rank 0's output."""
    with shared_tmp_dir() as trace_dir:
        ours = json_lines(demo_output([*FLAGS, "--trace", str(trace_dir)]))
        for rank in (0, 1):  # the trace file is the last step's record
            trace = json.loads((trace_dir / f"fsdp_trace.rank{rank}.json").read_text())
            last = next(s for s in ours if (s["rank"], s["step"]) == (rank, 1))
            assert trace["events"] == last["events"] and trace["spans"] == last["spans"]
    theirs = json_lines(demo_output([*FLAGS, "--use-torch-fsdp"]))
    assert sorted((s["rank"], s["step"]) for s in ours) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for a, b in zip(
        sorted(ours, key=lambda s: (s["rank"], s["step"])), sorted(theirs, key=lambda s: (s["rank"], s["step"]))
    ):
        assert a["loss"] == b["loss"]
        assert a["param_bytes_per_rank"] == b["param_bytes_per_rank"] == a["param_bytes_unsharded"] // 2
        assert [(e["op"], e["module"], e["phase"], e["nbytes"]) for e in a["events"]] == [
            (e["op"], e["module"], e["phase"], e["nbytes"]) for e in b["events"]
        ]
        assert in_issue_order([a]) == in_issue_order([b])  # compute and collectives, prefetches in the same places
        assert a["summary"]["all_gather"]["count"] == 5 and a["summary"]["reduce_scatter"]["count"] == 3
        assert {s["name"] for s in a["spans"]} >= {"layers.0 forward", "layers.1 backward", "root backward"}


SMALL = ("--fsdp", "--json", "--steps", "2", "--num-layers", "2", "--hidden-size", "32", "--batch-size", "4")
UNITS = ("root", "layers.0", "layers.1")  # forward order: the root encloses the layers (embedding before, loss after)


def forward_theory(prefetching: bool) -> list[tuple]:
    """Without forward prefetch each unit's all-gather is issued just before its own compute; with it, the next
    unit's is issued (by the current unit's pre-forward) before the current unit computes."""
    root, *layers = UNITS
    order = [("all_gather", root, False)] + [("all_gather", layers[0], True)] * prefetching + [("compute", root, None)]
    for layer, following in zip(layers, [*layers[1:], None]):
        if not prefetching:
            order.append(("all_gather", layer, False))
        elif following:
            order.append(("all_gather", following, True))
        order.append(("compute", layer, None))
    return [*order, ("compute ends", root, None)]


def backward_theory(mode: str) -> list[tuple]:
    """Backward runs the layers in reverse; the root, still unsharded, computes first (output layer, final norm)
    and last (embedding). BACKWARD_PRE issues the next unit's all-gather before the current unit's gradient
    computation, BACKWARD_POST after it (before the reduce-scatter), none only when the unit itself needs it."""
    root, *layers = UNITS
    backward = layers[::-1]
    order = [("all_gather", backward[0], True)] * (mode == "pre") + [("compute", root, None)]
    for index, (layer, following) in enumerate(zip(backward, [*backward[1:], None])):
        if mode == "none" or (mode == "post" and index == 0):
            order.append(("all_gather", layer, False))
        if mode == "pre" and following:
            order.append(("all_gather", following, True))
        order.append(("compute", layer, None))
        if mode == "post" and following:
            order.append(("all_gather", following, True))
        order.append(("reduce_scatter", layer, False))
    return [*order, ("compute ends", root, None), ("reduce_scatter", root, False)]


def issued(record: dict, phase: str) -> list[tuple]:
    return [(e["op"], e["unit"], e.get("prefetch")) for e in record["issue_order"] if e["phase"] == phase]


def in_issue_order(records: list[dict]) -> list[list[tuple]]:
    """Each rank's and step's issue order: compute and collectives, with their prefetch marks."""
    by_step = sorted(records, key=lambda r: (r["rank"], r["step"]))
    return [[(e["phase"], e["op"], e["unit"], e.get("prefetch")) for e in r["issue_order"]] for r in by_step]


@on_ranks(2)
@pytest.mark.parametrize("implementation", [[], ["--use-torch-fsdp"]], ids=["reference", "fsdp1"])
def test_issue_order_shows_where_each_prefetch_option_issues_the_all_gathers(ranks, implementation):
    """--json's issue order (compute and collectives interleaved), both ranks, both steps, of the reference and
    of PyTorch's FSDP1: forward prefetch moves the next unit's all-gather before the current unit's compute from
    the second step on (the first records the order), and each backward prefetch option moves it where the
    theory says, on every step."""
    for flags, prefetching, mode in (
        (["--backward-prefetch", "none"], False, "none"),
        (["--backward-prefetch", "pre"], False, "pre"),
        (["--backward-prefetch", "post"], False, "post"),
        (["--backward-prefetch", "none", "--forward-prefetch"], True, None),
    ):
        records = json_lines(demo_output([*SMALL, *flags, *implementation]))
        assert sorted((r["rank"], r["step"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for record in records:
            assert issued(record, "forward") == forward_theory(prefetching and record["step"] > 0), (flags, record)
            if mode:
                assert issued(record, "backward") == backward_theory(mode), (flags, record)
            in_order = sorted(record["events"], key=lambda e: e["start"])  # the same collectives as recorded
            assert [(e["op"], e["unit"], e["nbytes"]) for e in record["issue_order"] if "prefetch" in e] == [
                (e["op"], e["module"], e["nbytes"]) for e in in_order
            ]


@on_ranks(2)
def test_the_printed_last_step_lists_the_issue_order(ranks):
    """Without --json, rank 0 prints the last step's issue order, line for line, prefetches marked."""
    flags = [*SMALL, "--forward-prefetch"]
    last = next(r for r in json_lines(demo_output(flags)) if (r["rank"], r["step"]) == (0, 1))
    printed = demo_output([f for f in flags if f != "--json"]).split("issued them")[1].splitlines()[2:]
    shown = [line.split()[:3] + ["prefetch"] * line.endswith("prefetch") for line in printed if "total:" not in line]
    expected = [
        [e["phase"], *e["op"].split(), e["unit"]][:3] + ["prefetch"] * bool(e.get("prefetch"))
        for e in last["issue_order"]
    ]
    assert shown == expected and ["forward", "all_gather", "layers.1", "prefetch"] in shown


@on_ranks(2)
def test_with_forward_prefetch_backward_post_prefetches_nothing_as_in_fsdp1(ranks):
    """Forward prefetch builds unit l+1's parameter views before unit l's forward ops, and autograd runs the
    ready node created last first, so unit l+1's gradient accumulation (its post-backward hook) comes after unit
    l's backward has begun, all-gather included: BACKWARD_POST finds nothing left to prefetch, and both layers'
    reduce-scatters wait for the last layer's backward. PyTorch's FSDP1 does the same, entry for entry."""
    flags = [*SMALL, "--forward-prefetch", "--backward-prefetch", "post"]
    ours, theirs = json_lines(demo_output(flags)), json_lines(demo_output([*flags, "--use-torch-fsdp"]))
    assert in_issue_order(ours) == in_issue_order(theirs)
    last = in_issue_order(ours)[1]  # rank 0, step 1
    assert [(unit, early) for phase, op, unit, early in last if phase == "backward" and op == "all_gather"] == [
        ("layers.1", False),
        ("layers.0", False),
    ]
    backward = [(op, unit) for phase, op, unit, _ in last if phase == "backward"]
    assert backward.index(("reduce_scatter", "layers.1")) > backward.index(("compute", "layers.0"))

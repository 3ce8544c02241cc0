"""`torchrun -m reference --moe --ep E [--tp T]`: one-line refusals, and on 2 and 4 ranks (EP 2, EP 2 x TP 2) a
loss per step equal to the unsharded MoE layer trained in one process on every rank's tokens, every rank's
recorded all-to-all bytes equal to the closed form it prints, its split sizes and collectives those its routing
implies, and the traces the MoE walkthrough draws (reading_notes/traces/moe_*.json, tools/record-traces) a fresh
run's."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

from reference.__main__ import main
from reference.moe.demo import synthetic_tokens
from reference.moe.layer import MoELayer
from tests.launch import ROOT
from tests.ranks import on_ranks
from tests.reference.helpers import demo_output, json_lines
from tests.reference.refusals import refusal

ARGS = ["--hidden-size", "16", "--seq-length", "8", "--batch-size", "2", "--steps", "2", "--seed", "3"]
ARGS += ["--num-experts", "4", "--moe-aux-loss-coeff", "0", "--lr", "0.5", "--json"]
TRACES = ROOT / "reading_notes" / "traces"
TRACED = {
    2: ("moe_ep2", ["--ep", "2"]),
    4: ("moe_ep2_tp2", ["--ep", "2", "--tp", "2"]),
}  # tools/study/record_traces.MOE


@pytest.mark.parametrize(
    "world,args,message",
    [
        (1, ["--ep", "2"], "the data-parallel size (1) is not divisible by the expert-parallel size (2)"),
        (1, ["--moe-router-topk", "9"], "--moe-router-topk 9 must be between 1 and --num-experts 8"),
        (2, ["--pp", "2"], "--moe runs one MoE layer: no --pp and no --fsdp"),
        # the MoE walkthrough's exercise 1 quotes these two lines
        (3, ["--ep", "3"], "--num-experts (8) is not divisible by --ep (3)"),
        (4, ["--ep", "3"], "the data-parallel size (4) is not divisible by the expert-parallel size (3)"),
    ],
)
def test_bad_moe_sizes_are_refused_with_one_line(world, args, message, capsys, monkeypatch):
    monkeypatch.setitem(os.environ, "WORLD_SIZE", str(world))
    stderr = refusal(main, ["--moe", *args], capsys)
    assert stderr.strip() == f"reference: error: {message}", stderr


def unsharded_losses(world: int, tp: int) -> list[float]:
    """The plain layer, same seed, one SGD step per step on the mean of every rank's loss (its replica's slice)."""
    torch.manual_seed(3)
    layer = MoELayer(16, 32, 4, 2, aux_loss_coeff=0.0)
    teacher = torch.randn(16, 16, generator=torch.Generator().manual_seed(4)) / 16**0.5
    args = type("Args", (), {"seed": 3, "seq_length": 8, "batch_size": 2, "hidden_size": 16})
    optimizer, losses = torch.optim.SGD(layer.parameters(), lr=0.5), []
    for step in (1, 2):
        per_rank = [
            F.mse_loss(layer(x), y)
            for x, y in (
                synthetic_tokens(args, step, r // tp, teacher, r % tp, tp, "cpu", torch.float32) for r in range(world)
            )
        ]
        (sum(per_rank) / world).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(loss.item() for loss in per_rank) / world)
    return losses


@on_ranks(2, 4)
def test_moe_demo_trains_like_the_unsharded_layer_and_sends_the_closed_form_bytes(ranks):
    tp = ranks.world // 2
    config, *steps = json_lines(demo_output(["--moe", "--ep", "2", "--tp", str(tp), *ARGS]))
    if ranks.rank != 0:
        return
    assert (config["config"]["world"], config["config"]["tp"], config["config"]["ep"]) == (ranks.world, tp, 2)
    assert [s["step"] for s in steps] == [1, 2]
    for got, expected in zip([s["loss"] for s in steps], unsharded_losses(ranks.world, tp)):
        assert got == pytest.approx(expected, rel=1e-5)
    for s in steps:
        assert s["dropped"] == 0 and sum(s["pairs_per_expert"]) == s["tokens"] * 2
        assert all(r["a2a_bytes"] == r["closed_form"] > 0 for r in s["ranks"]), s["ranks"]


def report(args: list[str]) -> tuple[dict, list[dict]]:
    """The demo's `--json` config and steps, on every rank."""
    lines = json_lines(demo_output(["--moe", *args, "--json"]))
    return lines[0]["config"], lines[1:]


@on_ranks(2, 4)
def test_each_rank_reports_the_split_sizes_and_collectives_its_routing_implies(ranks):
    """Per rank: the pairs it sends each EP peer are its pairs for that peer's experts (input splits), those it
    receives are the peers' pairs for its experts (output splits), and its local experts compute what the ranks
    of its EP group (and, under TP, of its TP group) routed to them. Its all-to-alls: the [E] counts, the sent
    rows, the received rows back in forward; in backward the same rows the other way, each h values a row.
    Under TP 2, the expert-TP all-gather and reduce-scatter and the load-balancing loss's counts, over TP."""
    tp = ranks.world // 2
    config, (step,) = report(["--ep", "2", "--tp", str(tp), "--steps", "1", "--num-experts", "4"])
    experts, local, row = config["num_experts"], config["experts_per_rank"], config["hidden_size"] * 4
    every = {r["rank"]: r for r in step["ranks"]}
    owns = lambda r, peer: sum(every[r]["pairs_per_expert"][peer * local : (peer + 1) * local])
    for r, mine in every.items():
        peers = mine["ep_group"]
        me = peers.index(r)
        assert mine["input_splits"] == [owns(r, j) for j in range(len(peers))]
        assert mine["output_splits"] == [owns(p, me) for p in peers]
        group = {q for p in peers for q in every[p]["tp_group"]}
        assert mine["rows_per_local_expert"] == [
            sum(every[q]["pairs_per_expert"][me * local + e] for q in group) for e in range(local)
        ]
        sent, received = sum(mine["input_splits"]), sum(mine["output_splits"])
        a2a = [(c["phase"], c["nbytes"]) for c in mine["collectives"] if c["op"] == "all_to_all"]
        assert a2a == [
            ("forward", experts * 8),
            ("forward", sent * row),
            ("forward", received * row),
            ("backward", sent * row),
            ("backward", received * row),
        ]
        others = [(c["op"], c["phase"], c["group_ranks"]) for c in mine["collectives"] if c["op"] != "all_to_all"]
        if tp == 1:
            assert others == []
        else:
            gathered = [(op, phase) for op, phase, group_ranks in others if group_ranks == mine["tp_group"]]
            assert len(gathered) == len(others) and sorted(gathered) == sorted(
                [("all_reduce", "forward"), ("all_gather", "forward"), ("all_gather", "forward")]
                + [("reduce_scatter", "forward"), ("all_gather", "backward"), ("reduce_scatter", "backward")]
            )


@pytest.mark.freshness
@on_ranks(2, 4)
def test_the_walkthroughs_traces_are_a_fresh_run(ranks):
    name, args = TRACED[ranks.world]
    committed = json.loads((TRACES / f"{name}.json").read_text())
    config, steps = report([*args, "--steps", "1"])
    assert committed["config"] == config and committed["world"] == ranks.world
    for fresh, recorded in zip(steps, committed["steps"], strict=True):
        assert fresh.pop("loss") == pytest.approx(recorded.pop("loss"), rel=1e-6)
        assert fresh == recorded, f"reading_notes/traces/{name}.json is stale: re-record with tools/record-traces"


@on_ranks(2)
def test_the_text_report_prints_each_ranks_split_sizes(ranks):
    out = demo_output(["--moe", "--ep", "2", "--steps", "1"])
    lines = [line for line in out.splitlines() if line.startswith("  rank ") and " sent " in line]
    assert len(lines) == 2, out
    for line in lines:
        sent, splits_out, received, splits_in = re.match(
            r"  rank \d: sent (\d+) pairs \[(\d+, \d+)\], received (\d+) \[(\d+, \d+)\]: recorded", line
        ).groups()
        assert sum(map(int, splits_out.split(", "))) == int(sent) and sum(map(int, splits_in.split(", "))) == int(
            received
        )

"""The MoE scale trace: one process traces the MoE layers of one rank of a large job with expert parallelism
(fake process group, meta weights, the stated routing), and every (group, collective type) row and the bytes
held must equal reference.measure.scale.moe_formulas.

The committed traces are traced afresh; Mixtral's rows are also checked against numbers written out here from
its sizes; small layouts cover EP with TP and PP, EP 1 and EP = DP; a negative control shows the comparison
can fail; and the stated routing is checked on its own.
"""

from __future__ import annotations

import contextlib
import json

import pytest

from reference.measure.scale.__main__ import build_parser, main
from reference.measure.scale.moe_report import setup_from
from reference.measure.scale.moe_shapes import moe_setup_for
from reference.measure.scale.moe_simulate import default_ranks, document, step_of, summarize
from reference.measure.scale.routing import ep_rank_pairs, expert_counts, imbalance
from reference.parallel_state import ParallelConfigError
from study import record_traces  # the arguments of the committed MoE traces
from tests.launch import ROOT

TRACES = ROOT / "reading_notes" / "traces"


def table(rows):
    return {(r.group, r.op): (r.count, r.nbytes) for r in rows}


@pytest.fixture(scope="module")
def committed():
    """The committed MoE traces (tools/study/record_traces.MOE_SCALE), each traced here afresh (about 15 s): name ->
    (setup, [RankStep])."""
    runs = {}
    for name, argv in record_traces.MOE_SCALE.items():
        setup = setup_from(build_parser().parse_args(argv))
        runs[name] = setup, [step_of(setup, rank) for rank in default_ranks(setup)]
    return runs


@pytest.mark.freshness
def test_committed_moe_traces_match_a_fresh_run(committed):
    """reading_notes/traces/moe_scale_*.json are what `python -m reference.measure.scale ... --json` writes now, and
    every row and byte held in them agrees with the formulas."""
    assert sorted(committed) == sorted(p.stem for p in TRACES.glob("moe_scale_*.json"))
    for name, (setup, steps) in committed.items():
        fresh = json.loads(json.dumps(document(setup, steps)))
        assert fresh == json.loads((TRACES / f"{name}.json").read_text()), f"{name}.json is stale: tools/record-traces"
        assert fresh["agree"] and [run["ep_rank"] for run in fresh["runs"]] == [0, setup.ep - 1]


def test_mixtral_rows_in_numbers(committed):
    """Mixtral-8x7B at TP 2 x PP 4 x DP 16, EP 8, 16 micro-batches, Zipf 0.5, written out from the sizes: 8 MoE
    layers per stage, 2048 tokens per rank (4096 / t) routed top-2, expert 0 (EP rank 0's only expert) gets 937
    of the 4096 pairs, expert 7 331."""
    setup, (busiest, quietest) = committed["moe_scale_mixtral_8x7b"]
    h, f, e, m, layers, pairs = 4096, 14336, 2, 16, 8, 4096
    assert expert_counts(2048, 2, 8, 0.5) == [937, 663, 541, 468, 419, 383, 354, 331]
    for step, received in ((busiest, 8 * 937), (quietest, 8 * 331)):
        rows = table(summarize(setup, step.rank, step.events))
        n = m * layers
        assert rows[("ep", "all_to_all")] == (5 * n, n * (8 * 8 + 2 * (pairs + received) * h * e))
        assert rows[("tp", "all_gather")] == (3 * n, n * (8 * 2 * 8 + 2 * 2 * received * h * e))
        assert rows[("tp", "reduce_scatter")] == (2 * n, n * 2 * 2 * received * h * e)
        assert rows[("tp", "all_reduce")] == (n + 1, n * 4 * 8 + layers * 8 * h * e)  # aux loss; router grads
        assert rows[("dp", "all_reduce")] == (1, layers * 8 * h * e)  # 512 KiB of routers: one bucket
        expert = 3 * h * f // 2  # one expert per EP rank, split over TP 2
        assert rows[("edp", "all_reduce")] == (2 * layers, layers * expert * e)  # fc1 and fc2 each >= 25 MiB
        assert step.held == {
            "expert_parameters": e * layers * expert,
            "router_parameters": e * layers * 8 * h,
            "gradients": e * layers * (expert + 8 * h),
            "master_weights": 4 * layers * (expert + 8 * h),
            "optimizer_states": 8 * layers * (expert + 8 * h),
        }


SMALL = {
    "ep2": dict(tp=1, pp=1, dp=4, ep=2),
    "ep4-tp2-pp2": dict(tp=2, pp=2, dp=4, ep=4, order="tp-dp-pp"),
    "ep1-tp2": dict(tp=2, pp=1, dp=2, ep=1),
    "ep-equals-dp": dict(tp=1, pp=1, dp=4, ep=4, bucket_size=None),
}


@pytest.mark.parametrize("layout", SMALL.values(), ids=SMALL.keys())
def test_small_layouts_trace_what_the_formulas_say(layout):
    """The small MoE preset at skew 1 on every traced rank: every row and every byte held equals the formulas;
    the all-to-all bytes (and, under TP, the gathered rows) follow the rows each EP rank receives."""
    setup = moe_setup_for("moe-small", microbatches=2, routing_skew=1.0, **layout)
    doc = document(setup, [step_of(setup, rank) for rank in default_ranks(setup)])
    assert doc["agree"], [r for run in doc["runs"] for r in run["rows"] if r["count"] != r["formula_count"]]
    groups = {r["group"] for run in doc["runs"] for r in run["rows"]}
    assert ("ep" in groups) == (setup.ep > 1) and ("tp" in groups) == (setup.tp > 1)
    assert ("edp" in groups) == (setup.edp > 1)
    if setup.ep > 1:
        busiest, quietest = ({r["op"]: r["bytes"] for r in run["rows"] if r["group"] == "ep"} for run in doc["runs"])
        assert busiest["all_to_all"] > quietest["all_to_all"]


def test_uniform_routing_loads_every_ep_rank_alike():
    setup = moe_setup_for("moe-small", tp=1, pp=1, dp=4, ep=2, microbatches=1)
    first, last = (table(summarize(setup, s.rank, s.events)) for s in (step_of(setup, r) for r in default_ranks(setup)))
    assert first == last


def test_a_trace_of_another_routing_disagrees():
    """Negative control: the all-to-all bytes follow the routing, so the trace at skew 1 does not match the
    formulas at skew 0 (the other groups do: the routing moves no parameter)."""
    skewed = moe_setup_for("moe-small", tp=1, pp=1, dp=4, ep=2, microbatches=1, routing_skew=1.0)
    uniform = moe_setup_for("moe-small", tp=1, pp=1, dp=4, ep=2, microbatches=1)
    rows = summarize(uniform, 0, step_of(skewed, 0).events)
    assert [r.group for r in rows if not r.agrees] == ["ep"]


def test_routing_counts():
    assert expert_counts(64, 2, 8, 0.0) == [16] * 8
    assert expert_counts(10, 1, 4, 0.0) == [3, 3, 2, 2]  # the remainder to the lower indices
    capped = expert_counts(100, 4, 8, 3.0)  # expert 0's share would be 334.7 pairs of 400: capped at the 100 tokens
    assert capped[0] == 100 and sum(capped) == 400 and capped == sorted(capped, reverse=True)
    counts = expert_counts(2048, 8, 256, 0.5)
    assert sum(counts) == 2048 * 8 and max(counts) <= 2048
    assert ep_rank_pairs([5, 4, 3, 2, 1, 1], 3) == [9, 5, 2]
    stats = imbalance([5, 4, 3, 2, 1, 1], 3)
    assert stats["expert_max_over_mean"] == 5 / (16 / 6) and stats["ep_rank_received"] == [27, 15, 6]
    assert stats["busiest_ep_rank_over_mean"] == 27 / 16


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ep", "2"], "--ep and --routing-skew need a MoE model"),
        (["--model", "moe-small", "--pp", "2", "--dp", "4", "--tp", "1", "--ep", "2"], "needs order tp-dp-pp"),
        (["--model", "moe-small", "--pp", "1", "--dp", "4", "--tp", "1", "--ep", "3"], "num_experts (8)"),
        (["--model", "moe-small", "--pp", "1", "--dp", "2", "--ep", "2", "--routing-skew", "-1"], "routing skew"),
        (["--model", "moe-small", "--pp", "1", "--dp", "2", "--dp-sharding", "optimizer"], "not modelled for MoE"),
        (["--model", "moe-small", "--pp", "1", "--dp", "2", "--dp-sharding", "fsdp2"], "not modelled for MoE"),
    ],
    ids=["dense-model", "order", "experts", "skew", "distopt", "fsdp2"],
)
def test_bad_moe_setups_are_one_line_errors(capsys, argv, message):
    with contextlib.suppress(SystemExit):
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_cli_prints_the_moe_rows(capsys):
    argv = ["--model", "moe-small", "--tp", "2", "--pp", "1", "--dp", "4", "--ep", "2", "--micro-batches", "1"]
    assert main([*argv, "--routing-skew", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "moe-small MoE layers on tp 2 x pp 1 x dp 4 = 8 ranks, ep 2 x expert dp 2" in out
    assert "EP rank 0 (hottest experts)" in out and "EP rank 1 (coldest experts)" in out
    assert "MISMATCH" not in out
    with pytest.raises(ParallelConfigError):
        moe_setup_for("mixtral", tp=1, pp=1, dp=1, ep=1, microbatches=1)

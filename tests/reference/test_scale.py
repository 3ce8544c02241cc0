"""Scale by simulation: one process traces one rank of a large TP x PP x DP job (fake process group, meta
weights) running reference.gpt.train.train_step, and every (group, collective type) row must equal the closed
forms of reference.measure.scale.formulas.

The 70B rows are also checked against numbers written out here from the sizes (not from formulas.py), the
meta-device trace against the same step on real tensors, GPipe against 1F1B (same transfers, other order),
and two negative controls show the comparison can fail.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import pytest

from reference.measure.scale import formulas
from reference.measure.scale.__main__ import build_parser, main, setup_from
from reference.measure.scale.shapes import ScaleSetup, setup_for
from reference.measure.scale.simulate import (
    RankStep,
    default_ranks,
    document,
    shard_rank_of,
    simulate,
    stage_of,
    step_of,
    summarize,
    trace_rank,
)
from reference.parallel_state import Mesh, ParallelConfigError
from study import record_traces  # the arguments of the committed scale traces
from tests.launch import ROOT

M = 16  # micro-batches of the committed 70B traces (fewer than stages: the small layouts below)
A = 1 * 4096 * 8192 * 2  # one bf16 activation [s, b, h] of the 70B shape, bytes
L = 10  # layers per stage at PP 8
H, F, S, VOCAB_ROWS = 8192, 28672, 4096, 128256 // 8
TRACES = ROOT / "reading_notes" / "traces"


def table(rows):
    return {(r.group, r.op): (r.count, r.nbytes) for r in rows}


def assert_agrees(rows):
    wrong = [r for r in rows if not r.agrees]
    assert not wrong, f"traced != formula: {wrong}"


@functools.cache
def setup_of(name: str) -> ScaleSetup:
    """A committed scale trace's setup (tools/study/record_traces.SCALE: 70B at TP 8 x PP 8 x DP 64, plain, with
    SP, with the distributed optimizer; at TP 8 x DP 512 with FSDP2 and HSDP)."""
    return setup_from(build_parser().parse_args(record_traces.SCALE[name]))


@functools.cache
def step_at(name: str, stage: int) -> RankStep:
    """The committed trace's rank on `stage` (first, middle or last; the one stage at pp 1), traced once a
    process, when a test first reads it: each test pays for the ranks it reads (a few seconds each), so none
    runs long on a busy machine."""
    setup = setup_of(name)
    (rank,) = [rank for rank in default_ranks(setup) if stage_of(setup, rank) == stage]
    return step_of(setup, rank)


def steps_of(name: str) -> dict[int, RankStep]:
    """{stage: RankStep} of every rank the committed trace holds."""
    stages = [stage_of(setup_of(name), rank) for rank in default_ranks(setup_of(name))]
    return {stage: step_at(name, stage) for stage in stages}


def rows_of(name: str, stage: int):
    step = step_at(name, stage)
    return summarize(setup_of(name), step.rank, step.events)


@pytest.mark.freshness
@pytest.mark.parametrize("name", record_traces.SCALE)
def test_committed_scale_traces_match_a_fresh_run(name):
    """reading_notes/traces/scale_*.json are what `python -m reference.measure.scale ... --json` writes now (the
    document of the same setups and ranks), formula terms included."""
    assert sorted(record_traces.SCALE) == sorted(p.stem for p in TRACES.glob("scale_*.json"))
    setup = setup_of(name)
    committed = json.loads((TRACES / f"{name}.json").read_text())
    fresh = json.loads(json.dumps(document(setup, list(steps_of(name).values()))))
    assert fresh == committed, f"reading_notes/traces/{name}.json is stale: re-record with tools/record-traces"
    assert committed["agree"] and [run["stage"] for run in committed["runs"]] == ([0] if setup.fsdp2 else [0, 4, 7])


@pytest.mark.parametrize("name", [n for n in record_traces.SCALE if not setup_of(n).fsdp2])  # fsdp2: below
def test_70b_first_middle_last_stage_rows_equal_the_formulas(name):
    steps = steps_of(name)
    assert setup_of(name).microbatches == M and sorted(steps) == [0, 4, 7], name
    for stage in steps:
        assert_agrees(rows_of(name, stage))


def test_70b_without_sp_in_numbers():
    first, middle, last = (table(rows_of("scale_70b", p)) for p in (0, 4, 7))
    loss = 3 * M * 4096 * 4  # max, target logit, sum-exp: fp32 per token
    assert middle[("tp", "all_reduce")] == (4 * M * L, 4 * M * L * A)
    assert first[("tp", "all_reduce")] == (4 * M * L + M, (4 * M * L + M) * A)
    assert last[("tp", "all_reduce")] == (4 * M * L + M + 3 * M, (4 * M * L + M) * A + loss)
    assert middle[("pp", "send")] == middle[("pp", "recv")] == (2 * M, 2 * M * A)
    assert first[("pp", "send")] == last[("pp", "recv")] == (M, M * A)
    assert ("pp", "recv") in first and ("pp", "send") in last  # the gradients coming back
    assert middle[("pp", "barrier")] == (2, 0)
    block = 6 * H + (4 * H * H + 3 * H + 2 * H * F + F) // 8
    # DDP: bf16 gradients (2 bytes), buckets of >= 25 MiB; a block's grads close three buckets (fc2, fc1, then
    # ln2 + attention out + QKV), the ln1 of one block rides with the next one's fc2, the first block's ln1
    # is the last bucket (or rides with the embeddings on the first stage)
    assert middle[("dp", "all_reduce")] == (3 * L + 1, 2 * L * block)
    assert first[("dp", "all_reduce")] == (3 * L + 2, 2 * (L * block + (VOCAB_ROWS + S) * H))
    assert last[("dp", "all_reduce")] == (3 * L + 2, 2 * (L * block + 2 * H + VOCAB_ROWS * H))


def test_70b_ddp_buckets_in_order():
    """The middle stage's DP all-reduces, bucket by bucket, in the order backward fills them."""
    middle = step_at("scale_70b", 4).events
    sizes = [e.nbytes for e in middle if e.module == "dp"]
    fc2, fc1 = 2 * (H * F // 8 + H), 2 * (F * H // 8 + F // 8)
    attention = 2 * (2 * H + H * H // 8 + H + 3 * H * H // 8 + 3 * H // 8)
    ln = 2 * 2 * H
    assert sizes == [fc2, fc1, attention] + [ln + fc2, fc1, attention] * (L - 1) + [ln]
    assert all(
        e.op == "all_reduce" and e.dtype == "bfloat16" and e.phase == "backward"  # overlapped
        for e in middle
        if e.module == "dp"
    )


def test_70b_with_sp_in_numbers():
    first, middle, last = (table(rows_of("scale_70b_sp", p)) for p in (0, 4, 7))
    assert middle[("tp", "all_gather")] == (6 * M * L, 6 * M * L * A)
    assert middle[("tp", "reduce_scatter")] == (4 * M * L, 4 * M * L * A)
    assert middle[("tp", "all_reduce")] == (1, 6 * H * L * 2)  # SP LayerNorm and bias grads, bf16
    assert middle[("pp", "send")] == (2 * M, 2 * M * A // 8)  # the sequence shard crosses stages
    # the first stage all-reduces the embedding (positions are added to the full sequence), then splits it
    assert first[("tp", "all_reduce")] == (M + 1, M * A + 6 * H * L * 2)
    assert first[("tp", "all_gather")] == (6 * M * L + M, (6 * M * L + M) * A)
    assert last[("tp", "all_gather")] == (6 * M * L + 2 * M, (6 * M * L + 2 * M) * A)
    assert last[("tp", "reduce_scatter")] == (4 * M * L + M, (4 * M * L + M) * A)
    assert middle[("dp", "all_reduce")] == table(rows_of("scale_70b", 4))[("dp", "all_reduce")]


def test_70b_distributed_optimizer_holds_the_zero_bytes_and_moves_the_all_reduce_bytes():
    """The middle stage (10 blocks) of 70B at TP 8 x PP 8 x DP 64 with the distributed optimizer: its
    923,304,960 parameters per TP rank (per block 6h + (4h^2 + 2hf + 3h + f) / 8, written out from the sizes),
    in bf16 parameters and gradients, 12 / 64 bytes of fp32 master and Adam moments per parameter (no padding:
    every bucket is a multiple of 64 elements); the reduce-scatters and all-gathers are the DDP all-reduces'
    buckets, each as many bytes."""
    params = 10 * (6 * H + (4 * H * H + 2 * H * F + 3 * H + F) // 8)
    assert params == 923_304_960
    step = step_at("scale_70b_distopt", 4)
    assert setup_of("scale_70b_distopt").distributed_optimizer and step.rank == 32
    held, rows = step.held, table(rows_of("scale_70b_distopt", 4))
    assert held == {
        "parameters": 2 * params,
        "gradients": 2 * params,
        "master_weights": 4 * params // 64,
        "optimizer_states": 8 * params // 64,
    }
    ddp = table(rows_of("scale_70b", 4))[("dp", "all_reduce")]
    assert rows[("dp", "reduce_scatter")] == rows[("dp", "all_gather")] == ddp
    assert ("dp", "all_reduce") not in rows


def test_zero2_holds_a_gradient_shard_and_moves_the_distributed_optimizers_bytes():
    """ZeRO-2 (--dp-sharding gradients) on the small model at TP 2 x PP 2 x DP 4, 3 micro-batches, every stage:
    ZeRO-1's collectives and bytes, and what a rank holds with only the gradients divided by dp: e(Ψ + Ψ/N)
    of parameters and gradient shard besides ZeRO-1's 12Ψ/N."""
    layout = dict(tp=2, pp=2, dp=4, microbatches=3, bucket_size=10_000, distributed_optimizer=True)
    zero1, zero2 = setup_for("small", **layout), setup_for("small", **layout, shard_gradients=True)
    for rank in default_ranks(zero1):
        held1, held2 = {}, {}
        rows1 = table(summarize(zero1, rank, trace_rank(zero1, rank, held=held1)))
        rows2 = table(summarize(zero2, rank, trace_rank(zero2, rank, held=held2)))
        assert rows2 == rows1 and ("dp", "all_reduce") not in rows2
        assert held2 == {**held1, "gradients": held1["gradients"] // 4} == formulas.memory(zero2, stage_of(zero2, rank))
        assert held2["gradients"] == held2["parameters"] // 4


def test_70b_fsdp2_and_hsdp_in_numbers():
    """The same 4,096 ranks as TP 8 x DP 512, one stage (rank 0, shard rank 0), written out from the sizes: a TP
    rank's block holds 6h + (4h^2 + 2hf + 3h + f) / 8 parameters, every dim 0 a multiple of 512 (and of 64);
    the root its 128,256 / 8 = 16,032 vocabulary rows twice (embedding, head), padded per parameter to 16,384
    over 512 ranks and to 16,064 over 64, the 4,096 position rows and the final LayerNorm. Each rank holds
    4 + 4 + 8 bytes per parameter of its shard (fp32 shard, fp32 gradient, Adam); every block is all-gathered
    in bf16 twice, the root once, and every group reduce-scattered in fp32; HSDP all-reduces the fp32 gradient
    shards over its 8 replicas."""
    block = 6 * H + (4 * H * H + 2 * H * F + 3 * H + F) // 8
    layers = 80
    for name, shards, vocab_rows in (("scale_70b_fsdp2", 512, 16_384), ("scale_70b_hsdp", 64, 16_064)):
        setup, step = setup_of(name), step_at(name, 0)
        assert (setup.tp, setup.pp, setup.dp, setup.microbatches, setup.shard_size) == (8, 1, 512, 1, shards)
        root = 2 * vocab_rows * H + S * H + 2 * H
        shard = (root + layers * block) // shards
        assert step.rank == 0 and step.held == {
            "parameters": 4 * shard,
            "gradients": 4 * shard,
            "master_weights": 0,
            "optimizer_states": 8 * shard,
        }
        rows = table(rows_of(name, 0))
        group = "dp" if shards == 512 else "dp_shard"
        assert rows[(group, "all_gather")] == (2 * layers + 1, 2 * (root + 2 * layers * block))
        assert rows[(group, "reduce_scatter")] == (layers + 1, 4 * (root + layers * block))
        assert rows.get(("dp_replicate", "all_reduce")) == (None if shards == 512 else (layers + 1, 4 * shard))
        assert_agrees(rows_of(name, 0))
    assert 4 * (2 * 16_384 * H + S * H + 2 * H + layers * block) // 512 == 60_065_984  # the held parameters


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, dp=2),
        dict(tp=2, dp=3, sp=True),  # uneven: the last shard rank holds fewer rows
        dict(tp=1, dp=4, dp_replicate=2),
        dict(tp=2, dp=6, dp_replicate=3, sp=True, order="tp-dp-pp"),
    ],
    ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()),
)
def test_small_fsdp2_and_hsdp_layouts_equal_the_formulas(layout):
    setup = setup_for("small", pp=1, microbatches=1, fsdp2=True, **layout)
    for rank in (0, setup.world - 1):  # shard rank 0, and the last
        held = {}
        events = trace_rank(setup, rank, held=held)
        sizes = {"dp": setup.dp, "dp_shard": setup.shard_size, "dp_replicate": setup.dp_replicate, "tp": setup.tp}
        assert all(len(e.group_ranks) == sizes[e.module] and rank in e.group_ranks for e in events)
        rows = summarize(setup, rank, events)
        assert_agrees(rows)
        assert held == formulas.memory(setup, 0, shard_rank_of(setup, rank))
        dp_groups = {"dp_shard", "dp_replicate"} if setup.dp_replicate > 1 else {"dp"}
        assert {r.group for r in rows} == dp_groups | ({"tp"} if setup.tp > 1 else set())


@pytest.mark.parametrize("layout", [dict(tp=2, pp=4, dp=2), dict(tp=2, pp=3, dp=2, sp=True)], ids=["tp-pp4", "sp-pp3"])
def test_gpipe_and_1f1b_move_the_same_tensors_in_another_order(layout):
    setup = setup_for("small", microbatches=5, **layout)
    for rank in (int(rank) for rank in Mesh(setup.tp, setup.pp, setup.dp).grid[:, 0, 0]):  # every stage
        gpipe = trace_rank(dataclasses.replace(setup, schedule="gpipe"), rank)
        one_f_one_b = trace_rank(setup, rank)
        keys = [[(e.key(), e.module) for e in events] for events in (gpipe, one_f_one_b)]
        assert sorted(keys[0]) == sorted(keys[1])
        stage = stage_of(setup, rank)
        if 0 < stage < setup.pp - 1:  # a middle stage interleaves differently
            assert keys[0] != keys[1]


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, pp=2, dp=2),
        dict(tp=2, pp=2, dp=2, sp=True, schedule="gpipe"),
        dict(tp=4, pp=3, dp=2, sp=True),
        dict(tp=2, pp=4, dp=1),
        dict(tp=1, pp=2, dp=4, bucket_size=10_000),
        dict(tp=2, pp=1, dp=2, sp=True),
        dict(tp=2, pp=2, dp=3, order="tp-dp-pp", bucket_size=None),
        dict(tp=2, pp=2, dp=3, bucket_size=10_000, distributed_optimizer=True),
        dict(tp=1, pp=2, dp=4, sp=True, distributed_optimizer=True),
        dict(tp=2, pp=2, dp=3, bucket_size=10_000, distributed_optimizer=True, shard_gradients=True),
    ],
    ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()),
)
def test_small_layouts_every_stage_equals_the_formulas(layout):
    setup = setup_for("small", microbatches=3, **layout)
    for rank in {*default_ranks(setup), setup.world - 1}:  # every stage kind, and a last TP / DP rank
        held = {}
        rows = summarize(setup, rank, trace_rank(setup, rank, held=held))
        assert_agrees(rows)
        assert held == formulas.memory(setup, stage_of(setup, rank))
        groups = {r.group for r in rows}
        assert groups == {g for g, size in (("tp", setup.tp), ("pp", setup.pp), ("dp", setup.dp)) if size > 1}


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, pp=2, dp=2),
        dict(tp=2, pp=2, dp=2, sp=True, bucket_size=20_000),
        dict(tp=2, pp=2, dp=2, distributed_optimizer=True),
        dict(tp=2, pp=1, dp=4, sp=True, fsdp2=True, dp_replicate=2, microbatches=1),
    ],
    ids=["tp", "sp-buckets", "distopt", "hsdp"],
)
def test_meta_device_records_what_real_tensors_record(layout):
    setup = setup_for("small", **{"microbatches": 2, **layout})
    for rank in (0, 7):
        meta, real = trace_rank(setup, rank, "meta"), trace_rank(setup, rank, "cpu")
        assert [(e.key(), e.module, e.phase) for e in meta] == [(e.key(), e.module, e.phase) for e in real]


def test_a_wrong_formula_is_caught(monkeypatch, capsys):
    """With the formulas' PP send count off by one, that row and only that row disagrees, and the CLI
    marks it MISMATCH and exits 1."""
    setup = setup_for("small", tp=2, pp=2, dp=2, microbatches=2)
    events = trace_rank(setup, 2)
    assert all(r.agrees for r in summarize(setup, 2, events))
    real = formulas.expected
    monkeypatch.setattr(
        formulas,
        "expected",
        lambda s, stage, shard_rank=0: {
            key: [dataclasses.replace(t, count=t.count + 1) if key == ("pp", "send") else t for t in terms]
            for key, terms in real(s, stage, shard_rank).items()
        },
    )
    wrong = [r for r in summarize(setup, 2, events) if not r.agrees]
    assert [(r.group, r.op) for r in wrong] == [("pp", "send")]
    assert main(["--model", "small", "--tp", "2", "--pp", "2", "--dp", "2", "--microbatches", "2", "--rank", "2"]) == 1
    assert "MISMATCH: formula gives 3 x" in capsys.readouterr().out


def test_a_layout_change_is_caught():
    """A trace with SP compared with the formulas without it disagrees on every TP row and the PP rows."""
    with_sp = setup_for("small", tp=2, pp=2, dp=2, microbatches=2, sp=True)
    events = trace_rank(with_sp, 0)
    rows = summarize(dataclasses.replace(with_sp, sp=False), 0, events)
    assert {(r.group, r.op) for r in rows if not r.agrees} == {
        ("tp", "all_gather"),
        ("tp", "reduce_scatter"),
        ("tp", "all_reduce"),
        ("pp", "send"),
        ("pp", "recv"),
    }


def test_cli_exit_codes_and_json(capsys):
    assert main(["--model", "small", "--tp", "2", "--pp", "2", "--dp", "2", "--microbatches", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["agree"] and [run["stage"] for run in doc["runs"]] == [0, 1] and doc["world"] == 8
    assert main(["--model", "small", "--tp", "2", "--pp", "2", "--dp", "2", "--rank", "5", "--sp"]) == 0
    out = capsys.readouterr().out
    assert "rank 5 (pipeline stage 0 of 2)" in out and "6 m L x bshe" in out and "MISMATCH" not in out
    for argv, message in (
        (["--model", "small", "--pp", "5"], "5 pipeline stages but only 4 layers"),
        (["--model", "small", "--pp", "1", "--dp", "1", "--bucket-size", "-1"], "bucket size -1 must be a positive"),
        (["--model", "405b"], "unknown model '405b'"),
        (
            ["--model", "small", "--tp", "2", "--pp", "2", "--dp", "2", "--rank", "8"],
            "--rank 8 is outside the world of 8 ranks",
        ),
        (
            ["--model", "small", "--tp", "3", "--pp", "1", "--dp", "1"],
            "num_attention_heads (8) is not divisible by the tensor-parallel size (3)",
        ),
        (
            ["--model", "small", "--tp", "2", "--pp", "2", "--dp", "1", "--distributed-optimizer"],
            "the distributed optimizer shards the optimizer state over the data-parallel group, but dp is 1",
        ),
        (
            ["--model", "small", "--tp", "2", "--pp", "2", "--dp", "1", "--dp-sharding", "gradients"],
            "the distributed optimizer shards the optimizer state over the data-parallel group, but dp is 1",
        ),
        (
            ["--model", "small", "--tp", "2", "--pp", "2", "--dp", "2", "--dp-sharding", "fsdp2"],
            "--dp-sharding fsdp2 needs --pp 1 and --micro-batches 1 (got --pp 2 --micro-batches 16)",
        ),
        (
            ["--model", "small", "--tp", "2", "--pp", "1", "--dp", "4", "--dp-replicate", "2"],
            "--dp-replicate 2 is HSDP's; add --dp-sharding fsdp2",
        ),
        (
            ["--model", "small", "--pp", "1", "--dp", "4", "--micro-batches", "1", "--dp-sharding", "fsdp2"]
            + ["--dp-replicate", "3"],
            "--dp-replicate 3 does not divide dp 4",
        ),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err


def test_bad_setup_is_refused_before_any_process_group():
    with pytest.raises(ParallelConfigError, match="8 pipeline stages but only 4 layers"):
        setup_for("small", tp=1, pp=8, dp=1, microbatches=1)
    with pytest.raises(ParallelConfigError, match="seq_length .* not divisible"):
        dataclasses.replace(
            setup_for("small", tp=2, pp=1, dp=1, microbatches=1, sp=True),
            model=dataclasses.replace(setup_for("small", tp=1, pp=1, dp=1, microbatches=1).model, seq_length=33),
        )


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, pp=2, dp=2, virtual_stages=2),
        dict(tp=2, pp=2, dp=2, sp=True, virtual_stages=2, bucket_size=20_000),
        dict(tp=1, pp=2, dp=2, virtual_stages=2, microbatches=4),
        dict(tp=2, pp=4, dp=1, virtual_stages=1),
    ],
    ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()),
)
def test_interleaved_layouts_every_stage_equals_the_formulas(layout):
    setup = setup_for("small", **{"microbatches": 2, **layout})
    for rank in {*default_ranks(setup), setup.world - 1}:
        assert_agrees(simulate(setup, rank))


def test_interleaving_moves_v_times_the_pipeline_bytes_in_numbers():
    """pp 2, v 2, m 2 on the small model (one layer per chunk): a stage sends m v activations and input grads,
    less the model's first and last chunk-forwards, where plain 1F1B sends m (and the first stage none back);
    each chunk reduces its own gradients (a bucket per chunk here) and TP traffic per layer is unchanged."""
    m, v = 2, 2
    shape = setup_for("small", tp=2, pp=2, dp=2, microbatches=m).model
    a = shape.micro_batch_size * shape.seq_length * shape.hidden_size * 2
    plain = setup_for("small", tp=2, pp=2, dp=2, microbatches=m, bucket_size=None)
    chunked = dataclasses.replace(plain, virtual_stages=v)
    first, first_plain = table(simulate(chunked, 0)), table(simulate(plain, 0))
    assert first[("pp", "send")] == (m * v + m * (v - 1), (2 * m * v - m) * a)
    assert first_plain[("pp", "send")] == (m, m * a)
    assert first[("tp", "all_reduce")] == first_plain[("tp", "all_reduce")]
    assert first[("dp", "all_reduce")][0] == v and first_plain[("dp", "all_reduce")][0] == 1
    assert first[("dp", "all_reduce")][1] == first_plain[("dp", "all_reduce")][1]


def test_interleaving_bad_setups_are_refused_in_one_line(capsys):
    for argv, message in (
        (
            ["--model", "small", "--pp", "2", "--dp", "1", "--tp", "1", "--virtual-stages", "3"],
            "4 transformer layers do not split into pp 2 x 3 virtual stages",
        ),
        (
            ["--model", "small", "--pp", "2", "--dp", "1", "--tp", "1", "--virtual-stages", "2", "--microbatches", "3"],
            "needs the number of micro-batches (3) to be a multiple of the pipeline size (2)",
        ),
        (
            [
                "--model",
                "small",
                "--pp",
                "2",
                "--dp",
                "1",
                "--tp",
                "1",
                "--virtual-stages",
                "2",
                "--microbatches",
                "2",
                "--schedule",
                "gpipe",
            ],
            "2 virtual stages need the 1f1b schedule",
        ),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err


def test_progress_goes_to_stderr_a_line_per_traced_rank(capsys):
    """A 70B trace runs 15-30 s per rank: a line before each rank says what is being traced (it printed nothing
    for 40-45 s, issue #24), and the --json stdout stays one document."""
    argv = ["--model", "small", "--tp", "2", "--pp", "2", "--dp", "2", "--micro-batches", "2", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["agree"]
    *tracing, done = captured.err.splitlines()
    assert tracing == [
        "reference.measure.scale: tracing rank 0 (pipeline stage 0 of 2), 1 of 2 ...",
        "reference.measure.scale: tracing rank 2 (pipeline stage 1 of 2), 2 of 2 ...",
    ]
    assert re.fullmatch(r"reference\.measure\.scale: traced 2 ranks in \d+\.\d s", done), done

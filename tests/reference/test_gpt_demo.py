"""`torchrun -m reference --tp T --pp P --dp D [--dp-sharding fsdp|fsdp2]`: help, one-line errors, loss equal to the
unsharded GPT's, traffic per process group, parameter bytes per rank, and the schedule's measured in-flight
peak per stage."""

import functools
import json
import subprocess
import sys

import pytest

from reference.__main__ import main
from reference.gpt.model import GPT, GPTConfig
from tests.launch import ROOT
from tests.ranks import on_ranks
from tests.reference.helpers import demo_output, json_lines, shared_tmp_dir, unsharded_gpt_training
from tests.reference.refusals import refusal

FLAGS = [
    "--tp",
    "--pp",
    "--dp",
    "--schedule",
    "--micro-batches",
    "--sequence-parallel",
    "--vocab-size",
    "--dropout",
    "--no-async-grad-allreduce",
    "--trace",
    "--fsdp",
    "--dp-sharding",
]
MODEL = dict(vocab_size=51, hidden_size=16, num_attention_heads=4, num_layers=2, seq_length=8)
B, M, STEPS, SEED, LR = 2, 3, 3, 7, 0.5
FSDP_REFUSED = (
    "--dp-sharding {fsdp} needs --pp 1 and --micro-batches 1 (got --pp {pp} --micro-batches {m}): the "
    "reference {version} has no no_sync, so it cannot accumulate gradients over micro-batches and "
    "reduce-scatter once; use --dp-sharding replicate for pipelining"
)


def test_help_explains_every_flag():
    """The one end-to-end `python -m reference` of this file; the refusals below call main() in-process."""
    out = subprocess.run(
        [sys.executable, "-m", "reference", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for flag in FLAGS:
        assert flag in out.stdout, flag


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--pp", "4", "--num-layers", "2"],
            "4 pipeline stages need at least 4 transformer layers, the model has 2; lower --pp or raise --num-layers",
        ),
        (["--micro-batches", "0"], "--steps, --micro-batch-size, --micro-batches and --bucket-size must be >= 1"),
        (["--hidden-size", "10"], "hidden_size (10) is not divisible by num_attention_heads (4)"),
        (
            ["--tp", "2", "--pp", "2", "--dp-sharding", "fsdp"],
            FSDP_REFUSED.format(fsdp="fsdp", version="FSDP", pp=2, m=1),
        ),
        (
            ["--tp", "2", "--dp-sharding", "fsdp", "--micro-batches", "2"],
            FSDP_REFUSED.format(fsdp="fsdp", version="FSDP", pp=1, m=2),
        ),
        (
            ["--tp", "2", "--pp", "2", "--dp-sharding", "fsdp2"],
            FSDP_REFUSED.format(fsdp="fsdp2", version="FSDP2", pp=2, m=1),
        ),
        (
            ["--dp-sharding", "optimizer"],
            "--dp-sharding optimizer shards the optimizer state over the data-parallel "
            "group, but dp is 1 (world 1 / (tp 1 x pp 1)): nothing to shard; launch more ranks or use --dp-sharding "
            "replicate",
        ),
    ],
)
def test_bad_sizes_are_refused_with_one_line_before_starting(args, message, capsys):
    stderr = refusal(main, args, capsys)
    assert stderr.strip() == f"reference: error: {message}", stderr


def unsharded_losses() -> list[float]:
    return unsharded_gpt_training(GPTConfig(**MODEL), SEED, STEPS, LR, B * M * 2).losses


def demo_args(*extra: str, pp: int = 2, batch_size: int = B, micro_batches: int = M) -> list[str]:
    """The demo at tp 2 x pp x dp 2 on the global batch B x M x 2 of unsharded_losses."""
    return [
        "--tp",
        "2",
        "--pp",
        str(pp),
        "--dp",
        "2",
        "--json",
        "--steps",
        str(STEPS),
        "--batch-size",
        str(batch_size),
        "--micro-batches",
        str(micro_batches),
        "--seed",
        str(SEED),
        "--lr",
        str(LR),
        "--vocab-size",
        "51",
        "--hidden-size",
        "16",
        "--seq-length",
        "8",
        "--num-layers",
        "2",
        *extra,
    ]


def steps_and_pipeline(stdout: str) -> tuple[list[dict], dict | None]:
    """The step records and the pipeline record (None without one) of the demo's --json output."""
    lines = json_lines(stdout)
    return [x for x in lines if "step" in x], next((x for x in lines if "pipeline" in x), None)


THREE_D = [("gpipe", False), ("1f1b", True)]  # (schedule, sequence_parallel) of the tp 2 x pp 2 x dp 2 runs


@functools.cache
def three_d() -> dict:
    """The tp 2 x pp 2 x dp 2 (replicate) runs at world 8, once a rank: {(schedule, sequence_parallel): (steps,
    pipeline, the ops rank 0's trace file records)}."""
    found = {}
    for schedule, sp in THREE_D:
        with shared_tmp_dir() as trace:
            argv = demo_args("--schedule", schedule, "--trace", str(trace), *(["--sequence-parallel"] if sp else []))
            steps, pipeline = steps_and_pipeline(demo_output(argv))
            events = json.loads((trace / "gpt_trace.rank0.json").read_text())["events"]
        found[schedule, sp] = steps, pipeline, {e["op"] for e in events}
    return found


TP2_DP2 = {  # the tp 2 x pp 1 x dp 2 runs at world 4: FSDP x TP, its replicated twin, the distributed optimizer
    "fsdp": demo_args("--dp-sharding", "fsdp", "--sequence-parallel", pp=1, batch_size=B * M, micro_batches=1),
    "fsdp2": demo_args("--dp-sharding", "fsdp2", "--sequence-parallel", pp=1, batch_size=B * M, micro_batches=1),
    "fsdp_recompute_full": demo_args(
        "--dp-sharding", "fsdp", "--sequence-parallel", "--recompute", "full", pp=1, batch_size=B * M, micro_batches=1
    ),
    "replicate": demo_args(
        "--dp-sharding", "replicate", "--sequence-parallel", pp=1, batch_size=B * M, micro_batches=1
    ),
    "optimizer": demo_args("--dp-sharding", "optimizer", pp=1),
    "adam_replicate": demo_args("--dp-sharding", "replicate", "--optimizer", "adam", "--dtype", "bf16", pp=1),
    "adam_optimizer": demo_args("--dp-sharding", "optimizer", "--optimizer", "adam", "--dtype", "bf16", pp=1),
}


@functools.cache
def tp2_dp2_output(name: str) -> list[dict]:
    """The --json records of one of the TP2_DP2 runs (once a rank)."""
    return json_lines(demo_output(TP2_DP2[name]))


def tp2_dp2(name: str) -> list[dict]:
    """The step records of one of the TP2_DP2 runs."""
    return [x for x in tp2_dp2_output(name) if "step" in x]


@on_ranks(8)
@pytest.mark.parametrize("schedule, sequence_parallel", THREE_D)
def test_tp2_pp2_dp2_demo_trains_like_the_unsharded_gpt(ranks, schedule, sequence_parallel):
    steps, pipeline, traced_ops = three_d()[schedule, sequence_parallel]
    assert [s["step"] for s in steps] == [0, 1, 2]
    for got, expected in zip([s["loss"] for s in steps], unsharded_losses()):
        assert abs(got - expected) < 2e-6, (got, expected)
    s, b, h = 8, B, 16
    boundary = (s // 2 if sequence_parallel else s) * b * h * 4  # stages exchange [s/tp, b, h] under SP
    groups = steps[0]["collectives"]  # rank 0: stage 0, 1 layer
    assert groups["pp"] == {
        "barrier": {"count": 2, "bytes": 0},
        "send": {"count": M, "bytes": M * boundary},
        "recv": {"count": M, "bytes": M * boundary},
    }
    assert list(groups["dp"]) == ["all_reduce"] and groups["dp"]["all_reduce"]["count"] == 1
    if not sequence_parallel:  # embedding all-reduce, 2 per layer forward, 2 per layer backward
        assert groups["tp"] == {"all_reduce": {"count": 5 * M, "bytes": 5 * M * s * b * h * 4}}
    peaks = [(p["pp_rank"], p["peak_in_flight"], p["peak_in_flight_measured"]) for p in pipeline["pipeline"]]
    assert peaks == ([(0, M, M), (1, M, M)] if schedule == "gpipe" else [(0, 2, 2), (1, 1, 1)])
    assert traced_ops >= {"send", "recv", "all_reduce"}


@on_ranks(4)
def test_fsdp_x_tp_demo_trains_like_replicate_and_unsharded(ranks):
    """2D at world 4: FSDP over DP x TP with sequence and loss parallelism, one micro-batch of B x M rows per
    replica; the replicate run is the same tp 2 x dp 2 with --dp-sharding replicate (same global batches)."""
    fsdp = tp2_dp2("fsdp")
    replicate = tp2_dp2("replicate")
    losses = {
        "fsdp": [s["loss"] for s in fsdp],
        "replicate": [s["loss"] for s in replicate],
        "unsharded": unsharded_losses(),
    }
    for got, replicated, expected in zip(losses["fsdp"], losses["replicate"], losses["unsharded"]):
        assert abs(got - expected) < 2e-6 and abs(got - replicated) < 2e-6, losses
    layers = MODEL["num_layers"]
    for step in fsdp:  # root unit: one all-gather (kept for backward); each block: forward + backward
        dp = step["collectives"]["dp"]
        assert {op: v["count"] for op, v in dp.items()} == {
            "all_gather": 1 + 2 * layers,
            "reduce_scatter": 1 + layers,
        }, dp
    unsharded = sum(p.numel() * 4 for p in GPT(GPTConfig(**MODEL), SEED).parameters())
    assert fsdp[0]["param_bytes_unsharded"] == unsharded
    assert abs(fsdp[0]["param_bytes_per_rank"] / unsharded - 1 / 4) < 0.02  # + replicated LayerNorms, positions


@on_ranks(4)
def test_fsdp_x_tp_demo_recomputes_full_blocks_and_trains_as_without(ranks):
    """--dp-sharding fsdp --recompute full: each block's forward runs again in backward, after FSDP resharded it
    (it died on a size mismatch when the recomputed forward read the shard views); the same losses, the same DP
    traffic."""
    recomputed, fsdp = tp2_dp2("fsdp_recompute_full"), tp2_dp2("fsdp")
    for got, expected in zip([s["loss"] for s in recomputed], unsharded_losses()):
        assert abs(got - expected) < 2e-6, (got, expected)
    assert [s["loss"] for s in recomputed] == [s["loss"] for s in fsdp]
    assert [s["collectives"]["dp"] for s in recomputed] == [s["collectives"]["dp"] for s in fsdp]


@on_ranks(4)
def test_fsdp2_x_tp_demo_trains_like_fsdp_x_tp_bit_for_bit_with_its_schedule(ranks):
    """--dp-sharding fsdp2: the reference FSDP2 over DP x TP (reference.data_parallel.fsdp2_tp), with sequence
    and loss parallelism. The same compute and the same averages as FSDP1 x TP, so the same losses to the bit;
    on the DP group per step one all-gather per group in forward, one per block in backward (the root keeps its
    parameters), one reduce-scatter per group."""
    fsdp2, fsdp = tp2_dp2("fsdp2"), tp2_dp2("fsdp")
    assert [s["loss"] for s in fsdp2] == [s["loss"] for s in fsdp]
    assert {s["dp_sharding"] for s in fsdp2} == {"fsdp2"}
    layers, unsharded = MODEL["num_layers"], sum(p.numel() * 4 for p in GPT(GPTConfig(**MODEL), SEED).parameters())
    for step in fsdp2:
        ops = {op: v["count"] for op, v in step["collectives"]["dp"].items()}
        assert ops == {"all_gather": 1 + 2 * layers, "reduce_scatter": 1 + layers}
    assert fsdp2[0]["param_bytes_unsharded"] == unsharded
    assert abs(fsdp2[0]["param_bytes_per_rank"] / unsharded - 1 / 4) < 0.02  # tp 2 x dp 2, less the padding


@on_ranks(4)
def test_distributed_optimizer_demo_trains_like_the_unsharded_gpt(ranks):
    """tp 2 x dp 2 with --dp-sharding optimizer (ZeRO-1, SGD on fp32 slices): the unsharded losses; on the DP
    group one reduce-scatter of the gradients and one all-gather of the parameters per bucket and step, each
    of the whole fp32 buffer (what one all-reduce of it would be, twice: the ring sends (dp-1)/dp of each)."""
    steps = tp2_dp2("optimizer")
    for got, expected in zip([s["loss"] for s in steps], unsharded_losses()):
        assert abs(got - expected) < 2e-6, (got, expected)
    for step in steps:
        dp = step["collectives"]["dp"]
        assert list(dp) == ["reduce_scatter", "all_gather"] and dp["reduce_scatter"] == dp["all_gather"]
        assert dp["reduce_scatter"]["count"] == 1
        assert dp["reduce_scatter"]["bytes"] - step["param_bytes_per_rank"] in range(2 * 4)  # padded to dp


@on_ranks(4)
def test_distributed_optimizer_holds_half_the_masters_and_adam_moments_at_dp_2(ranks):
    """The memory report under Adam in bf16 (Megatron's mixed precision: bf16 parameters, fp32 main grads, fp32
    masters): DDP holds every fp32 master and both moments, 4 + 8 bytes per parameter of the stage; the
    distributed optimizer (ZeRO-1) holds 1/dp of each, and the same parameters and gradient buffers."""
    (ddp,) = [x["memory"] for x in tp2_dp2_output("adam_replicate") if "memory" in x]
    (zero1,) = [x["memory"] for x in tp2_dp2_output("adam_optimizer") if "memory" in x]
    for replicated, sharded in zip(ddp, zero1):
        numel = replicated["param_bytes"] // 2  # bf16
        assert replicated["master_weights"] == 4 * numel and replicated["optimizer_states"] == 8 * numel
        assert replicated["gradients"] == 4 * numel  # fp32 main grads
        assert sharded["param_bytes"] == replicated["param_bytes"]
        assert sharded["gradients"] - replicated["gradients"] in range(2 * 4)  # the buffer padded to dp
        assert sharded["master_weights"] - 2 * numel in range(4) and sharded["optimizer_states"] - 4 * numel in range(8)

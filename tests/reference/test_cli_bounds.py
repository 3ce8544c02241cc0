"""The reference CLIs refuse, at parse time and in one line with exit 2, values that would allocate petabytes,
run for hours, train on NaN or write a trace nowhere, and say the bound and why in the error and in --help."""

import pytest

from reference import __main__ as demo_cli
from reference import layout
from reference.arguments import MAX_BYTES_PER_RANK, refuse_large_memory
from reference.distributed import TIMEOUT_ENV, LaunchError, timeout_from_env
from reference.gpt import arguments as gpt_arguments
from reference.gpt.model import GPTConfig
from reference.measure.scale import __main__ as scale_cli
from reference.moe import demo as moe_demo

WORLD_WHY = "at most 1,048,576 (more than any job run so far; the groups list every rank)"


def refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "main, argv, message",
    [
        (
            layout.main,
            ["--tp", "100000", "--pp", "100000", "--dp", "100000"],
            f"python -m reference.layout: error: tp 100000 x pp 100000 x dp 100000 = 1,000,000,000,000,000 ranks; "
            f"{WORLD_WHY}",
        ),
        (
            scale_cli.main,
            ["--dp", "1000000000"],
            f"python -m reference.measure.scale: error: argument --dp: {WORLD_WHY}, got 1,000,000,000",
        ),
        (
            scale_cli.main,
            ["--tp", "8", "--pp", "8", "--dp", "65536"],
            "python -m reference.measure.scale: error: tp 8 x pp 8 x dp 65536 = 4,194,304 ranks",
        ),
        (
            scale_cli.main,
            ["--microbatches", "1000000"],
            "python -m reference.measure.scale: error: argument --microbatches: at most 256 "
            "(the trace walks every micro-batch of the schedule, about 0.3 s each per traced rank), got 1,000,000",
        ),
        (demo_cli.main, ["--lr", "nan"], "argument --lr: expected a positive, finite learning rate, got 'nan'"),
        (demo_cli.main, ["--lr", "inf"], "argument --lr: expected a positive, finite learning rate, got 'inf'"),
        (demo_cli.main, ["--lr", "0"], "argument --lr: expected a positive, finite learning rate, got '0'"),
        (demo_cli.main, ["--lr=-1e-3"], "argument --lr: expected a positive, finite learning rate, got '-1e-3'"),
        (demo_cli.main, ["--trace", "/proc/nope"], "argument --trace: cannot create directory '/proc/nope'"),
    ],
)
def test_out_of_bounds_values_are_refused_in_one_line_before_any_work(main, argv, message, capsys):
    assert message in refused(main, argv, capsys)


def test_a_trace_path_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert "cannot create directory" in refused(demo_cli.main, ["--trace", str(tmp_path / "file" / "x")], capsys)


def test_help_states_the_bounds_and_why(capsys):
    for main in (layout.main, scale_cli.main):
        with pytest.raises(SystemExit):
            main(["--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "At most 1,048,576 ranks" in text
    with pytest.raises(SystemExit):
        scale_cli.main(["--help"])
    assert "256 micro-batches (the trace walks every micro-batch" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--moe", "--num-experts", "2000000"], "argument --num-experts: at most 4,096 (the layer holds a module"),
        (["--seq-length", "50000000"], "argument --seq-length: at most 1,048,576"),
        (["--moe", "--moe-expert-capacity-factor", "inf"], "expected a positive, finite capacity factor, got 'inf'"),
        (["--moe", "--moe-expert-capacity-factor", "nan"], "expected a positive, finite capacity factor, got 'nan'"),
        (["--moe", "--moe-expert-capacity-factor", "0"], "expected a positive, finite capacity factor, got '0'"),
        (["--moe", "--moe-ffn-hidden-size", "-5"], "argument --moe-ffn-hidden-size: must be >= 1, got -5"),
        (["--moe", "--moe-ffn-hidden-size", "0"], "argument --moe-ffn-hidden-size: must be >= 1, got 0"),
        (["--fsdp", "--steps", "-1"], "argument --steps: must be >= 1, got -1"),
        (["--moe", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--hidden-size", "0"], "argument --hidden-size: must be >= 1, got 0"),
    ],
)
def test_demo_sizes_out_of_bounds_are_refused_at_parse_time(argv, message, capsys):
    assert message in refused(demo_cli.main, [*argv, "--device", "cpu"], capsys)


@pytest.mark.parametrize(
    "argv, largest",
    [
        (["--seq-length", "1000000"], "activations (--num-layers x --seq-length"),
        (["--fsdp", "--seq-length", "200000"], "activations (--num-layers x --seq-length"),
        (["--moe", "--num-experts", "4096", "--hidden-size", "4096"], "experts (--num-experts / --ep x --hidden-size"),
        (["--moe", "--seq-length", "1000000", "--micro-batch-size", "1000"], "routed tokens (--seq-length x"),
    ],
)
def test_demo_sizes_past_a_ranks_memory_are_refused_before_any_process_group(argv, largest, capsys, monkeypatch):
    """From the estimate of one rank's bytes, in the parent of no process group (no torchrun: a refusal past
    this point would say so instead)."""
    monkeypatch.delenv("RANK", raising=False)
    err = refused(demo_cli.main, [*argv, "--device", "cpu"], capsys)
    assert err.startswith("reference: error: this ") and f"most of it {largest}" in err, err
    assert "GiB per rank (this machine's memory over its local ranks" in err


def test_the_default_demos_fit_with_room_to_spare():
    parser = demo_cli.build_parser()
    gpt = parser.parse_args([])
    gpt.micro_batches = 4
    config = GPTConfig.from_sizes(gpt)
    assert sum(gpt_arguments.memory_per_rank(config, gpt, split=1, shards=1, in_flight=4).values()) < 64 << 20
    moe = parser.parse_args(["--moe"])
    assert sum(moe_demo.memory_per_rank(moe, tp=1).values()) < 64 << 20
    assert refuse_large_memory("x", {"a": MAX_BYTES_PER_RANK + 1}).startswith("x needs about 64.0 GiB per rank")


def test_a_routing_skew_past_its_bound_is_refused_in_one_line(capsys):
    argv = ["--model", "moe-small", "--dp", "2", "--ep", "2", "--micro-batches", "1", "--routing-skew"]
    too_large, negative = (refused(scale_cli.main, [*argv, skew], capsys) for skew in ("1e308", "-1"))
    assert "argument --routing-skew: below 64 (the coldest expert's share would underflow" in too_large
    assert "expected a positive, finite routing skew (a Zipf exponent, or 0), got '-1'" in negative


@pytest.mark.parametrize("text", ["1e300", "1e14", "1.5", "1e-9"])
def test_a_timeout_from_the_environment_outside_its_range_is_refused_in_one_line(monkeypatch, text):
    monkeypatch.setenv(TIMEOUT_ENV, text)
    with pytest.raises(LaunchError, match=rf"^{TIMEOUT_ENV}='{text}': expected 3 to 604,800 seconds"):
        timeout_from_env(120)

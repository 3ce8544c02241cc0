"""The reference CLIs refuse, at parse time and in one line with exit 2, values that would allocate petabytes,
run for hours, train on NaN or write a trace nowhere, and say the bound and why in the error and in --help."""

import pytest

from reference import __main__ as demo_cli
from reference import layout
from reference.measure.scale import __main__ as scale_cli

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

"""`python -m reference.measure.calibrate` measures the blocks the traces ran, at the traces' own FLOP counts,
writes a file the site accepts and draws from, refuses bad input in one line, and never leaves half a file.

Run in-process at the notes' tiny shapes with few repeats (a few seconds); the CUDA form runs the same command
on a GPU when one is visible, and the CUDA timing path is also driven on CPU with stand-in events."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from reference.measure import calibrate
from study import plugin
from study.calibration import load_calibration
from study.traces import load_trace
from tests.reference.gpus import DEVICES
from tests.tools.conftest import ROOT

NOTES = ROOT / "reading_notes"
QUICK = ["--only", "pipeline", "fsdp", "tp_block_llama-h64", "--warmup", "1", "--repeats", "3"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = calibrate.main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def matmul_flops(op: dict) -> int:
    """2 m n k of x [m, k] @ W[n, k]^T, forward; the backward's dX and dW are twice that."""
    (m, k), (n, _) = op["shapes"][:2]
    return 2 * m * n * k * (1 if op["phase"] == "forward" else 2)


@pytest.mark.parametrize("device", DEVICES)
def test_the_command_measures_every_op_of_the_traces_blocks_and_the_site_draws_from_its_file(capsys, tmp_path, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device, found none")
    out = tmp_path / "calibrations" / "here.json"
    out.parent.mkdir()
    code, stdout, stderr = run(capsys, *QUICK, "--device", device, "--out", str(out), "--json")
    assert code == 0, stderr
    document = json.loads(out.read_text())
    assert json.loads(stdout) == document
    assert stderr.count("\n") == 3 and all(line.startswith("calibrate: ") for line in stderr.splitlines())
    assert (document["device_type"], document["torch"]) == (device, torch.__version__)
    assert document["dtype"] == ("float32" if device == "cpu" else "bfloat16")  # what the device trains in
    blocks = {b["name"]: b for b in document["blocks"]}
    assert list(blocks) == ["pipeline", "fsdp", "tp_block_llama-h64"]
    for block in blocks.values():
        for op in block["ops"]:
            assert op["seconds"] > 0 and op["tflops"] == pytest.approx(op["flops"] / op["seconds"] / 1e12)
            if op["op"] in ("qkv", "proj", "fc1", "fc2"):
                assert op["flops"] == matmul_flops(op)
        for phase in ("forward", "backward"):
            ops = [op for op in block["ops"] if op["phase"] == phase]
            assert [op["op"] for op in ops] == [op["op"] for op in block["ops"][::2]]
            assert block[phase]["flops"] == sum(op["flops"] for op in ops)
            assert block[phase]["seconds"] == pytest.approx(sum(op["seconds"] for op in ops))
    # The blocks are the traces' own: a FSDP layer unit's forward span counted exactly the "fsdp" block's FLOPs,
    # and a middle pipeline stage's forward the "pipeline" block's but attention (the CPU flash kernel counts 0)
    # once per layer it holds.
    fsdp, pipeline = load_trace(NOTES, "fsdp_forward"), load_trace(NOTES, "pipeline_1f1b")
    span = next(s for s in fsdp["spans"] if s["name"] == "layers.0 forward")
    assert span["flops_end"] - span["flops_start"] == blocks["fsdp"]["forward"]["flops"]
    attention = next(op for op in blocks["pipeline"]["ops"] if op["op"] == "attention")
    stage = pipeline["stages"][1]
    layers_per_stage = pipeline["layers"] // pipeline["pp"]
    assert stage["action_flops"][stage["actions"].index("F0")] == layers_per_stage * (
        blocks["pipeline"]["forward"]["flops"] - attention["flops"]
    )
    # The site reads the file as it is written (schema-checked) and labels the timeline with its device.
    assert load_calibration(tmp_path, "here") == document
    (tmp_path / "traces").symlink_to(NOTES / "traces")
    html = plugin.helpers(SimpleNamespace(notes_dir=tmp_path))["diagram"](
        "fsdp_forward", calibration="here", link_GBps=25
    )
    assert f"modeled at the rates of {document['device']}, torch {torch.__version__}, {document['dtype']}" in html


def test_with_a_gpu_visible_cuda_and_bf16_are_the_defaults_and_cuda_events_time_each_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    parser = calibrate.build_parser()
    # With an index: torch.cuda.set_device refuses a bare "cuda" on torch 2.11 (as it did on an H200).
    assert calibrate.parse_device(parser, None) == torch.device("cuda", 0)
    clock, log = [0.0], []

    class Event:  # a CUDA event on a device whose kernels take what `work` adds to the clock
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = clock[0]
            log.append("record")

        def synchronize(self):
            log.append("wait")

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3  # milliseconds, as CUDA reports them

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: log.append("synchronize"))
    durations = iter([9.0, 9.0, 0.003, 0.001, 0.002])  # two warmup runs, then three timed ones, in seconds

    def work():
        clock[0] += next(durations)
        log.append("run")

    assert calibrate.median_seconds(work, torch.device("cuda"), warmup=2, repeats=3) == pytest.approx(0.002)
    assert log == ["run", "run", "synchronize"] + ["record", "run", "record", "wait"] * 3


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--device", "meta"], "--device 'meta': only cuda and cpu are measured"),
        (["--device", "gpu0"], "--device 'gpu0' is not a torch device; use cuda, cuda:N or cpu"),
        (["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        (["--warmup", "x"], "argument --warmup: expected a whole number, got 'x'"),
        (["--only", "70b"], "argument --only: invalid choice: '70b'"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["--out", "/nonexistent/dir/c.json"], "not a file in an existing folder"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, problem):
    code, stdout, stderr = run(capsys, *argv)
    assert code == 2 and stdout == "" and problem in stderr and stderr.count("\n") == 1, stderr
    assert stderr.startswith("python -m reference.measure.calibrate: error: ")


def test_cuda_without_a_visible_gpu_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, stderr = run(capsys, "--device", "cuda:1")
    assert code == 2 and f"no CUDA device is visible to torch {torch.__version__}" in stderr
    assert stderr.count("\n") == 1


def test_a_run_that_fails_leaves_the_previous_file_whole(capsys, tmp_path, monkeypatch):
    out = tmp_path / "c.json"
    out.write_text("the previous calibration\n")

    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(calibrate, "measure_block", out_of_memory)
    code, _, stderr = run(capsys, "--device", "cpu", "--out", str(out))
    assert code == 1 and stderr == (
        "python -m reference.measure.calibrate: error: cpu ran out of memory; measure fewer blocks with --only\n"
    )
    assert out.read_text() == "the previous calibration\n" and [p.name for p in tmp_path.iterdir()] == ["c.json"]
    monkeypatch.setattr(
        calibrate, "measure_block", lambda block, *args: {p: {"tflops": 1.0} for p in ("forward", "backward")}
    )

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(calibrate.os, "replace", disk_full)  # the file is written, the rename fails
    code, _, stderr = run(capsys, "--device", "cpu", "--only", "fsdp", "--out", str(out))
    assert code == 1 and stderr.splitlines()[-1] == (
        f"python -m reference.measure.calibrate: error: cannot write {out}: No space left on device"
    )
    assert out.read_text() == "the previous calibration\n" and [p.name for p in tmp_path.iterdir()] == ["c.json"]


def test_help_teaches_the_blocks_and_the_site(capsys):
    code, stdout, _ = run(capsys, "--help")
    assert code == 0
    for text in ("70b-tp8", "gpt2, tp 8: s 4096 x b 1 tokens, h 8192", "reading_notes/calibrations/", "--only"):
        assert text in stdout

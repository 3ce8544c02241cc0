"""`torchrun -m reference --tp T --pp P --dp D`: help, one-line errors, loss equal to the unsharded GPT's,
traffic per process group, and the schedule's measured in-flight peak per stage."""
import json
import subprocess
import sys

import pytest
import torch

from reference.gpt.model import GPTConfig, UnshardedGPT
from reference.gpt.train import synthetic_batches
from tests.launch import ROOT, torchrun

FLAGS = ["--tp", "--pp", "--dp", "--schedule", "--micro-batches", "--sequence-parallel", "--vocab-size",
         "--dropout", "--no-async-grad-allreduce", "--trace", "--fsdp"]
MODEL = dict(vocab_size=51, hidden_size=16, num_attention_heads=4, num_layers=2, seq_length=8)
B, M, STEPS, SEED, LR = 2, 3, 3, 7, 0.5


def _python_m_reference(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reference", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_help_explains_every_flag():
    out = _python_m_reference("--help")
    assert out.returncode == 0
    for flag in FLAGS:
        assert flag in out.stdout, flag


@pytest.mark.parametrize("args, message", [
    (["--pp", "4", "--num-layers", "2"],
     "4 pipeline stages need at least 4 transformer layers, the model has 2; lower --pp or raise --num-layers"),
    (["--micro-batches", "0"], "--steps, --batch-size, --micro-batches and --bucket-size must be >= 1"),
    (["--hidden-size", "10"], "hidden_size (10) is not divisible by num_attention_heads (4)"),
])
def test_bad_sizes_are_refused_with_one_line_before_starting(args, message):
    out = _python_m_reference(*args)
    assert out.returncode == 2 and out.stderr.strip() == f"reference: error: {message}", out.stderr


def unsharded_losses() -> list[float]:
    config = GPTConfig(**MODEL)
    model = UnshardedGPT(config, SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for tokens in synthetic_batches(config, STEPS, B * M * 2, SEED):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def demo(*extra: str) -> tuple[list[dict], dict]:
    args = ["--tp", "2", "--pp", "2", "--dp", "2", "--json", "--steps", str(STEPS), "--batch-size", str(B),
            "--micro-batches", str(M), "--seed", str(SEED), "--lr", str(LR), "--vocab-size", "51",
            "--hidden-size", "16", "--seq-length", "8", "--num-layers", "2", *extra]
    lines = [json.loads(line) for line in torchrun("-m", 8, "reference", *args, timeout=180).splitlines()
             if line.startswith("{")]
    return [x for x in lines if "step" in x], next(x for x in lines if "pipeline" in x)


@pytest.mark.parametrize("schedule, sequence_parallel", [("gpipe", False), ("1f1b", True)])
def test_tp2_pp2_dp2_demo_trains_like_the_unsharded_gpt(tmp_path, schedule, sequence_parallel):
    steps, pipeline = demo("--schedule", schedule, *(["--sequence-parallel"] if sequence_parallel else []),
                           "--trace", str(tmp_path))
    assert [s["step"] for s in steps] == [0, 1, 2]
    for got, expected in zip([s["loss"] for s in steps], unsharded_losses()):
        assert abs(got - expected) < 2e-6, (got, expected)
    s, b, h = 8, B, 16
    boundary = (s // 2 if sequence_parallel else s) * b * h * 4  # stages exchange [s/tp, b, h] under SP
    groups = steps[0]["collectives"]  # rank 0: stage 0, 1 layer
    assert groups["pp"] == {"barrier": {"count": 2, "bytes": 0}, "send": {"count": M, "bytes": M * boundary},
                            "recv": {"count": M, "bytes": M * boundary}}
    assert list(groups["dp"]) == ["all_reduce"] and groups["dp"]["all_reduce"]["count"] == 1
    if not sequence_parallel:  # embedding all-reduce, 2 per layer forward, 2 per layer backward
        assert groups["tp"] == {"all_reduce": {"count": 5 * M, "bytes": 5 * M * s * b * h * 4}}
    peaks = [(p["pp_rank"], p["peak_in_flight"], p["peak_in_flight_measured"]) for p in pipeline["pipeline"]]
    assert peaks == ([(0, M, M), (1, M, M)] if schedule == "gpipe" else [(0, 2, 2), (1, 1, 1)])
    trace = json.loads((tmp_path / "gpt_trace.rank0.json").read_text())
    assert {e["op"] for e in trace["events"]} >= {"send", "recv", "all_reduce"}

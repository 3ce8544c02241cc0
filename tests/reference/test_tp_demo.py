"""The `torchrun -m reference` entry point of the TP demo: help, per-step JSON, TP-size-independent loss."""
import json
import subprocess
import sys

from tests.launch import ROOT, torchrun

DEMO = ROOT / "reference" / "__main__.py"
TP_FLAGS = ["--tp-size", "--sequence-parallel", "--pad-sequence", "--no-async-grad-allreduce",
            "--no-grad-accumulation-fusion", "--dropout", "--trace"]


def test_help_explains_every_tensor_parallel_flag():
    out = subprocess.run([sys.executable, "-m", "reference", "--help"], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    for flag in TP_FLAGS:
        assert flag in out, flag


def _steps(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"step"')]


def test_demo_loss_is_the_same_at_tp1_and_tp2_and_traffic_is_reported(tmp_path):
    args = ["--json", "--steps", "3", "--seq-length", "8", "--hidden-size", "32", "--num-layers", "2"]
    single = _steps(torchrun(DEMO, 1, *args, timeout=120))
    double = _steps(torchrun(DEMO, 2, *args, "--sequence-parallel", "--trace", str(tmp_path), timeout=120))
    assert [s["step"] for s in single] == [s["step"] for s in double] == [0, 1, 2]
    for a, b in zip(single, double):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a["loss"], b["loss"])
    assert single[0]["collectives"] == {"forward": {}, "backward": {}, "grad_sync": {}}
    n = 8 * 2 * 32 * 4  # s * b * h * fp32
    assert double[0]["collectives"]["forward"] == {"all_gather": {"count": 5, "bytes": 5 * n},
                                                   "reduce_scatter": {"count": 4, "bytes": 4 * n}}
    trace = json.loads((tmp_path / "tp_trace.rank0.json").read_text())
    assert {s["name"] for s in trace["spans"]} == {"forward", "backward", "grad_sync"}
    assert any(e["module"] == "layers.1.mlp.fc2" for e in trace["events"])

"""Bad input to the TP reference: one clear line naming the problem, a non-zero exit, never a hang."""
from pathlib import Path

import pytest

from tests.launch import ROOT, torchrun, torchrun_failing
from tests.reference.gpus import CUDA_ENV, require_gpus

WORKERS = Path(__file__).parent / "workers"


def test_bad_configurations_raise_one_line_errors():
    out = torchrun(WORKERS / "tp_bad_input_worker.py", 2, timeout=120)
    assert out.count("bad input ok") == 2


def test_demo_refuses_world_not_divisible_by_tp_with_one_line_error():
    with pytest.raises(pytest.fail.Exception) as failure:
        # 6 heads: tp 3 splits them, so the refusal is the world's (the heads are checked before launch)
        torchrun(ROOT / "reference" / "__main__.py", 2, "--tp", "3", "--num-attention-heads", "6",
                 "--hidden-size", "48", timeout=120)
    message = str(failure.value)
    assert "exited 1" in message or "exited 2" in message, message[-2000:]
    assert "reference: error: the world size (2) is not divisible by tp 3 x pp 1 (3)" in message
    assert "[rank0]: Traceback" not in message and "[rank1]: Traceback" not in message


def test_rank_crash_mid_step_ends_the_run_in_bounded_time():
    message, _ = torchrun_failing(WORKERS / "tp_crash_worker.py", 2)
    assert "simulated crash of rank 1" in message
    assert "unreachable on rank 0" not in message


@pytest.mark.cuda
def test_bad_configurations_raise_one_line_errors_cuda():
    require_gpus(2)
    out = torchrun(WORKERS / "tp_bad_input_worker.py", 2, timeout=120, env=CUDA_ENV)
    assert out.count("bad input ok") == 2

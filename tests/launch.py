"""Launch a script under torchrun from pytest: bounded in time, failing with every rank's output.

tests/ranks.py launches tests/on_rank.py this way for the @on_ranks tests; a test that must see a job end
(a script in tests/reference/crashes/, the real `torchrun -m reference` command) calls `torchrun` or
`torchrun_failing` itself. Each rank writes to its own log file (torchrun `--redirects`), so lines of different
ranks never interleave; a failure shows torchrun's own output, then each rank's, in rank order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CRASHES = ROOT / "tests" / "reference" / "crashes"  # scripts in which a rank fails on purpose


# The torch the notes cite (constraints.txt). Off it, the tests that run torch's own code as upstream evidence
# skip (tests/reference/conftest.py).
PINNED_TORCH = next(
    line.removeprefix("torch==")
    for line in (ROOT / "constraints.txt").read_text().splitlines()
    if line.startswith("torch==")
)


def on_pinned_torch() -> bool:
    import torch

    return torch.__version__.split("+")[0] == PINNED_TORCH


def require_gpus(count: int) -> None:
    import torch

    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA device(s), one per rank, found {torch.cuda.device_count()}")


def torchrun(
    script: str | Path, nproc: int, *args: str, timeout: float = 300, env: dict | None = None, module: bool = False
) -> str:
    """Run `script` (a module name with module=True) on `nproc` local ranks (gloo on CPU unless the script picks
    NCCL); return its output.

    The whole process group is killed on timeout, so a hung collective fails the test instead of the suite.
    """
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "--max-restarts=0",
            f"--log-dir={logs}",
            "--redirects=3",
            *(["-m"] if module else []),
            str(script),
            *args,
        ]
        full_env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "TORCH_CPP_LOG_LEVEL": "ERROR",
            **(env or {}),
        }
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            launcher_out, _ = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            launcher_out, _ = proc.communicate()
            timed_out = True
        out = launcher_out + _rank_logs(Path(logs))
    if timed_out:
        pytest.fail(f"torchrun {Path(script).name} x{nproc} timed out after {timeout}s:\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun {Path(script).name} x{nproc} exited {proc.returncode}:\n{out[-6000:]}")
    return out


def torchrun_failing(
    script: str | Path, nproc: int, *args: str, timeout: float = 90, env: dict | None = None
) -> tuple[str, float]:
    """Run a script in which a rank fails on purpose; return every rank's output and the seconds it took.

    Fails the test if the run succeeded or hung: a crashed rank must end the whole job (torchrun tears the
    peers down), never leave a survivor blocked in a collective until `timeout`.
    """
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        torchrun(script, nproc, *args, timeout=timeout, env=env)
    message, elapsed = str(failure.value), time.monotonic() - start
    assert "timed out" not in message, message[-2000:]
    return message, elapsed


def _rank_logs(logs: Path) -> str:
    """Every rank's stdout then stderr, in rank order (files: <run>/attempt_0/<rank>/std{out,err}.log)."""
    files = sorted(logs.rglob("std*.log"), key=lambda f: (int(f.parent.name), f.name != "stdout.log"))
    return "".join(f.read_text(errors="replace") for f in files)

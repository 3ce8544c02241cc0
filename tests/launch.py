"""Launch a worker script under torchrun from pytest: bounded in time, failing with every rank's output.

Tests that need several ranks put their assertions in a worker script (each rank asserts, a failing
rank exits non-zero and torchrun tears the others down) and call `torchrun(...)` from a pytest test.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300, env: dict | None = None) -> str:
    """Run `script` on `nproc` local ranks (gloo on CPU unless the script picks NCCL); return its output.

    The whole process group is killed on timeout, so a hung collective fails the test instead of the suite.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                "TORCH_CPP_LOG_LEVEL": "ERROR", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun {Path(script).name} x{nproc} timed out after {timeout}s:\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun {Path(script).name} x{nproc} exited {proc.returncode}:\n{out[-6000:]}")
    return out

"""Collective sizes and groups at scale, traced by one process posing as a rank of a large job (torch's
`fake` process-group backend): what the notes' formulas predict for TP=8 inside a 64-rank world."""

import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.launch import ROOT, WORKERS


@functools.cache
def trace(rank: int, world: int, tp: int) -> dict:
    """Both steps (tp, sp) recorded by one process posing as `rank`."""
    with tempfile.TemporaryDirectory(prefix="fake-pg-") as out:
        subprocess.run(
            [sys.executable, str(WORKERS / "fake_pg_worker.py"), out, str(rank), str(world), str(tp)],
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            capture_output=True,
            timeout=120,
            check=True,
        )
        return json.loads((Path(out) / f"rank{rank}.json").read_text())


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_collective_bytes_and_groups_at_scale_with_fake_process_group(sp):
    tp, world, rank = 8, 64, 19
    result = trace(rank, world, tp)["sp" if sp else "tp"]
    assert result["tp_rank"] == rank % tp
    n = (2 * tp) * 3 * (8 * tp) * 4  # s * b * h * fp32, independent of the TP size
    block = [e for e in result["events"] if e["module"].startswith("layers.0")]
    assert {tuple(e["group_ranks"]) for e in result["events"]} == {tuple(range(16, 24))}
    assert {e["nbytes"] for e in block} == {n}
    per_phase = {phase: sorted(e["op"] for e in block if e["phase"] == phase) for phase in ("forward", "backward")}
    if sp:
        assert per_phase == {
            "forward": ["all_gather"] * 2 + ["reduce_scatter"] * 2,
            "backward": ["all_gather"] * 4 + ["reduce_scatter"] * 2,
        }
    else:
        assert per_phase == {"forward": ["all_reduce"] * 2, "backward": ["all_reduce"] * 2}

"""`torchrun -m reference --fsdp`: per-step collective schedule and per-rank parameter memory, and the
`--use-torch-fsdp` swap printing the same schedule from PyTorch's FSDP1."""

from __future__ import annotations

import json

from tests.ranks import on_ranks
from tests.reference.helpers import demo_output, json_lines, shared_tmp_dir

FLAGS = (
    "--fsdp",
    "--json",
    "--steps",
    "2",
    "--forward-prefetch",
    "--backward-prefetch",
    "pre",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--batch-size",
    "4",
)


@on_ranks(2)
def test_demo_json_reports_schedule_memory_and_matches_use_torch_fsdp(ranks):
    """Both demo runs on the two ranks; every rank asserts on rank 0's output."""
    with shared_tmp_dir() as trace_dir:
        ours = json_lines(demo_output([*FLAGS, "--trace", str(trace_dir)]))
        for rank in (0, 1):  # the trace file is the last step's record
            trace = json.loads((trace_dir / f"fsdp_trace.rank{rank}.json").read_text())
            last = next(s for s in ours if (s["rank"], s["step"]) == (rank, 1))
            assert trace["events"] == last["events"] and trace["spans"] == last["spans"]
    theirs = json_lines(demo_output([*FLAGS, "--use-torch-fsdp"]))
    assert sorted((s["rank"], s["step"]) for s in ours) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for a, b in zip(
        sorted(ours, key=lambda s: (s["rank"], s["step"])), sorted(theirs, key=lambda s: (s["rank"], s["step"]))
    ):
        assert a["loss"] == b["loss"]
        assert a["param_bytes_per_rank"] == b["param_bytes_per_rank"] == a["param_bytes_unsharded"] // 2
        assert [(e["op"], e["module"], e["phase"], e["nbytes"]) for e in a["events"]] == [
            (e["op"], e["module"], e["phase"], e["nbytes"]) for e in b["events"]
        ]
        assert a["summary"]["all_gather"]["count"] == 5 and a["summary"]["reduce_scatter"]["count"] == 3
        assert {s["name"] for s in a["spans"]} >= {"layers.0 forward", "layers.1 backward", "root backward"}

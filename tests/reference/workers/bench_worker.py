"""Every benchmark smoke run in one launch: `torchrun --nproc-per-node 2 bench_worker.py OUT`.

Runs each of RUNS as `python benchmarks/SCRIPT ARGS` would (runpy, `__main__`, sys.argv), one after another
in the same processes, and writes each rank's captured stdout per run to OUT/rank{R}.json: one torch import
per rank instead of one per benchmark. A benchmark sets up and tears down its own default process group
(reference.distributed.distributed), so they cannot run inside common.serve's; and a second group set up on
torchrun's store would find the first one's keys there (the same "default_pg" prefix and group name), so each
run rendezvouses on a store of its own (`fresh_store`). A benchmark that fails (an exception, SystemExit)
fails the launch with its output.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import socket
import sys
from pathlib import Path

import torch.distributed as dist

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
DECODER = ["--hidden-size", "32", "--num-attention-heads", "4", "--num-kv-heads", "2", "--seq-length", "8"]
DECODER += ["--vocab-size", "64", "--rounds", "1", "--json"]
PIPELINE = ["--hidden-size", "16", "--num-layers", "4", "--seq-length", "8", "--micro-batches", "2"]
PIPELINE += ["--micro-batch-size", "1", "--steps", "1", "--warmup", "0", "--virtual-stages", "2", "--json"]
DISTOPT = ["--hidden-size", "16", "--num-layers", "1", "--seq-length", "4", "--batch-size", "1", "--steps", "1"]
RUNS = {  # name: (script, arguments), tiny sizes: the tests check the reports, not the timings
    "decoder/tp": ("bench_decoder.py", DECODER),
    "decoder/tp_sp": ("bench_decoder.py", [*DECODER, "--sequence-parallel"]),
    "distopt": ("bench_distopt.py", [*DISTOPT, "--json"]),
    "pipeline": ("bench_pipeline.py", PIPELINE),
}


def fresh_store(agent: dist.Store, name: str) -> None:
    """Point env:// at a new TCPStore for run `name`: rank 0 picks a free port and tells the others through
    torchrun's `agent` store; rank 0's rendezvous then hosts the new store there (TORCHELASTIC_USE_AGENT_STORE
    off)."""
    key = f"bench_worker/{name}/port"
    if os.environ["RANK"] == "0":
        with socket.socket() as probe:
            probe.bind((os.environ["MASTER_ADDR"], 0))
            agent.set(key, str(probe.getsockname()[1]))
    os.environ["MASTER_PORT"] = agent.get(key).decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(False)


def run(script: str, args: list[str]) -> str:
    """What `python benchmarks/script args` prints on this rank."""
    argv, captured = sys.argv, io.StringIO()
    sys.argv = [str(BENCHMARKS / script), *args]
    try:
        with contextlib.redirect_stdout(captured):
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = argv
    return captured.getvalue()


def main() -> None:
    out = Path(sys.argv[1])
    sys.path.insert(0, str(BENCHMARKS))  # as for a script in benchmarks/: bench_decoder imports qwen2_dtensor
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    outputs = {}
    for name, (script, args) in RUNS.items():
        fresh_store(agent, name)
        outputs[name] = run(script, args)
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(outputs))


if __name__ == "__main__":
    main()

"""Every benchmark smoke run in one launch: `torchrun --nproc-per-node 2 bench_worker.py OUT`.

Runs each of RUNS as `python benchmarks/SCRIPT ARGS` would (runpy, `__main__`, sys.argv), one after another
in the same processes, and writes each rank's captured stdout per run to OUT/rank{R}.json: one torch import
per rank instead of one per benchmark. The worker sets the process group up once; a benchmark's
reference.distributed.distributed() runs on a group it finds set up and leaves it, as for the demo runs
(demo_worker.py). A benchmark that fails (an exception, SystemExit) fails the launch, its output printed.
"""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

from common import serve

from tests.launch import on_pinned_torch

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
DECODER = ["--hidden-size", "32", "--num-attention-heads", "4", "--num-kv-heads", "2", "--seq-length", "8"]
DECODER += ["--vocab-size", "64", "--rounds", "1", "--json"]
PIPELINE = ["--hidden-size", "16", "--num-layers", "4", "--seq-length", "8", "--micro-batches", "2"]
PIPELINE += [
    "--micro-batch-size",
    "1",
    "--steps",
    "1",
    "--warmup",
    "0",
    "--virtual-stages",
    "2",
    "--json",
    "--device",
    "cpu",
]
DISTOPT = ["--hidden-size", "16", "--num-layers", "1", "--seq-length", "4", "--batch-size", "1", "--steps", "1"]
RUNS = {  # name: (script, arguments), tiny sizes: the tests check the reports, not the timings
    "decoder/tp": ("bench_decoder.py", DECODER),
    "decoder/tp_sp": ("bench_decoder.py", [*DECODER, "--sequence-parallel"]),
    "distopt": ("bench_distopt.py", [*DISTOPT, "--json"]),
    "pipeline": ("bench_pipeline.py", PIPELINE),
}


def run(script: str, args: list[str]) -> str:
    """What `python benchmarks/script args` prints on this rank."""
    argv, captured = sys.argv, io.StringIO()
    sys.argv = [str(BENCHMARKS / script), *args]
    try:
        with contextlib.redirect_stdout(captured):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except BaseException:
        print(captured.getvalue(), end="")  # what it said before failing, into the launch's output
        raise
    finally:
        sys.argv = argv
    return captured.getvalue()


def main() -> None:
    sys.path.insert(0, str(BENCHMARKS))  # as for a script in benchmarks/: bench_decoder imports qwen2_dtensor
    # bench_decoder runs HF Qwen2 under torch's own DTensor plan, upstream evidence of the pinned torch only
    # (test_bench_decoder skips elsewhere; on torch 2.11 DTensor refuses the plan's attention reshape)
    runs = {name: entry for name, entry in RUNS.items() if on_pinned_torch() or not name.startswith("decoder/")}
    serve(lambda _device: {name: run(script, args) for name, (script, args) in runs.items()})


if __name__ == "__main__":
    main()

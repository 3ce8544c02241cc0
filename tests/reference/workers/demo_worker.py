"""Several runs of the demo (`torchrun -m reference ARGS`) in one launch: one torch import per rank for all.

Arguments: the output folder, then one JSON list of demo arguments per run. The worker sets up the process
group once and calls `reference.__main__.main(argv)` for each run in turn; the demo runs on a group it finds
set up and leaves it (reference.distributed.distributed). Each run gets the group's device (`--device`, from
REFERENCE_TEST_DEVICE), so `auto` cannot pick CUDA for a gloo group on a machine with a GPU. This rank's
stdout of each run, in order, goes to OUT/rank{R}.json as {"stdout": [...]}.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

from common import device_type, serve

from reference.__main__ import main as demo_main


def run_all(runs: list[list[str]]) -> dict:
    """This rank's stdout of each demo run, in order."""
    stdouts = []
    for argv in runs:
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            demo_main([*argv, "--device", device_type()])
        stdouts.append(captured.getvalue())
    return {"stdout": stdouts}


def main() -> None:
    runs = [json.loads(argv) for argv in sys.argv[2:]]
    serve(lambda _device: run_all(runs))


if __name__ == "__main__":
    main()

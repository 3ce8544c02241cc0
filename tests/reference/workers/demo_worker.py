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

from common import device_type, init, write_results

from reference.__main__ import main as demo_main
from reference.distributed import finish


def main() -> None:
    runs = [json.loads(argv) for argv in sys.argv[2:]]
    init()
    stdouts = []
    for argv in runs:
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            demo_main([*argv, "--device", device_type()])
        stdouts.append(captured.getvalue())
    write_results(sys.argv[1], {"stdout": stdouts})
    finish()


if __name__ == "__main__":
    main()

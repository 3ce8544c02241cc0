"""Several workers in one launch: `shared_worker.py OUT WORKER...` (module names, e.g. tp_claims_worker).

Each named worker's `results(device)` runs in turn on the same process group, in the order given, and each
rank writes {worker: its results} to OUT/rank{R}.json. One launch imports torch (and megatron-core) once per
rank instead of once per worker; tests/launch.run_worker picks which workers share a launch (SHARED).
"""

import importlib
import sys

from common import serve


def main() -> None:
    workers = {name: importlib.import_module(name) for name in sys.argv[2:]}
    serve(lambda device: {name: worker.results(device) for name, worker in workers.items()})


if __name__ == "__main__":
    main()

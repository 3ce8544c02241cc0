"""Several workers in one launch: `shared_worker.py OUT WORKER...` (module names, e.g. fsdp_worker).

Each named worker's `results(device)` runs in turn on the same process group, in the order given, the groups it
made destroyed after it (common.groups_of_the_block), and each rank writes {worker: its results} to
OUT/rank{R}.json. One launch imports torch (and megatron-core) once per rank instead of once per worker;
tests/launch.run_worker picks which workers share a launch (SHARED).
"""

import importlib
import sys

from common import groups_of_the_block, serve


def main() -> None:
    workers = {name: importlib.import_module(name) for name in sys.argv[2:]}

    def results(device) -> dict:
        found = {}
        for name, worker in workers.items():
            with groups_of_the_block():  # the next worker starts with none of this one's groups
                found[name] = worker.results(device)
        return found

    serve(results)


if __name__ == "__main__":
    main()

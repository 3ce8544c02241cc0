"""The rank side of tests/ranks.py: `torchrun -m tests.on_rank SPEC OUT` runs, on this rank, the bodies of the
tests SPEC lists, in order, and writes OUT/{i}.rank{R}.json (outcome, traceback) and OUT/{i}.rank{R}.log (what
the body printed) for the i-th.

After each body the ranks exchange outcomes on a gloo group of the harness's own, so a rank still blocked in a
collective (until the launch's group timeout) cannot be matched with another rank's next one. All passed: the
groups the body made are destroyed and the next test starts. A failure: every rank stops, and tests/ranks.py
launches again for the tests not yet run; so it does when the launch has run its budget (no test starts after it).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from _pytest.assertion.rewrite import rewrite_asserts

from reference.distributed import finish, init_distributed
from reference.measure.torch_patches import live_process_groups


class Ranks(NamedTuple):
    """What a test body gets: this rank, the world size, this rank's device and the default group."""

    rank: int
    world: int
    device: torch.device
    group: dist.ProcessGroup


def load_body(path: str, module: str, name: str):
    """The undecorated body of test `name` in the file at `path`, its asserts rewritten as pytest rewrites them."""
    if module not in sys.modules:
        spec = importlib.util.spec_from_file_location(module, path)
        loaded = importlib.util.module_from_spec(spec)
        source = Path(path).read_bytes()
        tree = ast.parse(source)
        rewrite_asserts(tree, source, path)
        sys.modules[module] = loaded
        exec(compile(tree, path, "exec"), loaded.__dict__)
    return getattr(sys.modules[module], name).body


@contextlib.contextmanager
def output_to(log: Path):
    """This process's stdout and stderr (file descriptors 1 and 2) appended to `log` for the block."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1), os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


def run(test: dict, ranks: Ranks, log: Path, timeout_s: float) -> dict:
    with output_to(log):
        try:
            load_body(test["path"], test["module"], test["name"])(ranks, **test["params"])
        except pytest.skip.Exception as skip:
            return {"outcome": "skipped", "message": skip.msg}
        except BaseException as error:  # noqa: B036 - an assertion, an error, a timed-out collective, a sys.exit
            timed_out = "Timed out" in str(error)  # gloo's words; NCCL's watchdog says "Timeout"
            hint = (
                f"\n(a peer never joined this collective within @on_ranks(timeout_s={timeout_s}))" if timed_out else ""
            )
            return {"outcome": "failed", "message": traceback.format_exc() + hint}
    return {"outcome": "passed", "message": ""}


def out_of_budget(started: float, budget_s: float, world: int, harness: dist.ProcessGroup) -> bool:
    """Has this launch run `budget_s` already? Rank 0's clock decides for every rank, so all stop together."""
    verdict = [time.monotonic() - started > budget_s] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(verdict, src=0, group=harness)
    return verdict[0]


def every_rank_started(timeout_s: float) -> None:
    """Wait up to `timeout_s` in torchrun's rendezvous store until every rank has started. Then the group's own
    timeout, as short as a hung-rank test sets it (2 s), bounds its collectives, not how long the other ranks
    took to import torch on a busy machine; on a quiet one this costs a round trip to the store."""
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    store.set(f"tests/started/{rank}", "1")
    store.wait([f"tests/started/{r}" for r in range(world)])


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    every_rank_started(spec["launch_timeout_s"])
    device = init_distributed(spec["device"], spec["timeout_s"])
    ranks = Ranks(dist.get_rank(), dist.get_world_size(), device, dist.group.WORLD)
    harness = dist.new_group(backend="gloo", timeout=timedelta(seconds=spec["launch_timeout_s"]))
    started = time.monotonic()
    for index, test in enumerate(spec["tests"]):
        if index and out_of_budget(started, spec["budget_s"], ranks.world, harness):
            break  # a clean end: tests/ranks.py launches again for the tests not yet run
        before = set(live_process_groups())
        result = run(test, ranks, out / f"{index}.rank{ranks.rank}.log", spec["timeout_s"])
        (out / f"{index}.rank{ranks.rank}.json").write_text(json.dumps(result))
        outcomes = [None] * ranks.world
        dist.all_gather_object(outcomes, result["outcome"], group=harness)
        if "failed" in outcomes:  # the groups may hold unmatched collectives: leave without touching them
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(0)
        for group in live_process_groups():
            if group not in before:
                dist.destroy_process_group(group)
    dist.destroy_process_group(harness)
    finish()


if __name__ == "__main__":
    main()

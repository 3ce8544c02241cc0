"""Tests whose body runs on every rank of a torchrun launch, as torchtitan's DTensorTestBase/@with_comms runs them.

    @on_ranks(2, 4, devices=DEVICES)          # test_x[2ranks-cpu], test_x[4ranks-cpu], test_x[2ranks-cuda], ...
    def test_x(ranks):                        # ranks: .rank, .world, .device, .group (tests/on_rank.Ranks)
        total = torch.ones(1, device=ranks.device)
        dist.all_reduce(total)
        assert total.item() == ranks.world

Each rank runs the body (gloo on CPU, NCCL on CUDA). The test passes when every rank passed, fails with each
failing rank's traceback and output, skips when a rank skipped or there are fewer GPUs than ranks. Other
arguments come from pytest.mark.parametrize. The first such test at a (world, device, timeout) launches once for
all of them the session collected, in order; a failure or a dead launch is reported on its test, the rest
relaunched."""

from __future__ import annotations

import inspect
import json
import os
import re
import tempfile
from pathlib import Path

import pytest

from tests.launch import ROOT, require_gpus, torchrun

LAUNCH_TIMEOUT_S = 540  # a launch's whole run: under pytest-timeout's 600 s for the test that starts it
LAUNCH_BUDGET_S = 240  # no test starts in a launch after this; the rest go to the next launch (one test's room left)
_RESULTS = pytest.StashKey[dict]()  # nodeid -> every rank's result, for this session
_ID = re.compile(r"\[(?:.+-)?(\d+ranks-(?:cpu|cuda))(?:-.+)?\]$")


def on_ranks(*worlds: int, devices=("cpu",), timeout_s: float = 60):
    """Run the decorated body on `worlds` ranks, on each of `devices`; a collective waits `timeout_s` for its
    peers before it raises (the launch's group timeout)."""

    def decorate(body):
        extra = list(inspect.signature(body).parameters.values())[1:]  # the parametrized arguments after `ranks`

        def test(ranks_at, request, **params):
            world, device = ranks_at
            if device == "cuda":
                require_gpus(world)
            per_rank = _results_of(request.node)
            failed = [(r, result) for r, result in enumerate(per_rank) if result["outcome"] != "passed"]
            if any(result["outcome"] == "failed" for _, result in failed):
                pytest.fail("\n".join(_report(r, result) for r, result in failed), pytrace=False)
            if failed:
                pytest.skip(f"rank {failed[0][0]}: {failed[0][1]['message']}")

        test.__dict__.update(body.__dict__)  # marks applied below @on_ranks (pytestmark)
        test.__name__, test.__qualname__, test.__doc__ = body.__name__, body.__qualname__, body.__doc__
        test.__module__, test.body, test.timeout_s = body.__module__, body, timeout_s
        test.__signature__ = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("ranks_at", "request")] + extra
        )
        params = [
            pytest.param((w, d), id=f"{w}ranks-{d}", marks=[pytest.mark.cuda] if d == "cuda" else [])
            for d in [getattr(d, "values", [d])[0] for d in devices]
            for w in worlds
        ]
        return pytest.mark.parametrize("ranks_at", params)(test)

    return decorate


def launch_of(nodeid: str) -> str | None:
    """The launch an @on_ranks test runs in ("2ranks-cpu"), else None. tests/conftest.py keeps each launch's
    tests in one xdist worker: they share it."""
    found = _ID.search(nodeid)
    return found and found.group(1)


def _key(item: pytest.Item) -> tuple:
    return (*item.callspec.params["ranks_at"], item.function.timeout_s)


def _results_of(item: pytest.Item) -> list[dict]:
    """Every rank's result of `item`, launching for it (and every collected test sharing its key) if needed."""
    done = item.session.stash.setdefault(_RESULTS, {})
    while item.nodeid not in done:
        pending = [
            i
            for i in item.session.items
            if isinstance(i, pytest.Function)
            and hasattr(i.function, "body")
            and i.nodeid not in done
            and i.get_closest_marker("skip") is None  # e.g. torch's own evidence off the pinned torch
        ]
        done.update(_launch([i for i in pending if _key(i) == _key(item)], *_key(item)))
    return done[item.nodeid]


def _launch(items: list[pytest.Item], world: int, device: str, timeout_s: float) -> dict:
    """Run `items` in one launch; each one run gets its ranks' results, the one a dead launch died in a failure."""
    tests = [
        {
            "path": str(i.path),
            "module": i.module.__name__,
            "name": i.originalname,
            "params": {k: v for k, v in i.callspec.params.items() if k != "ranks_at"},
        }
        for i in items
    ]
    spec = {
        "device": device,
        "timeout_s": timeout_s,
        "launch_timeout_s": LAUNCH_TIMEOUT_S,
        "budget_s": LAUNCH_BUDGET_S,
        "tests": tests,
    }
    with tempfile.TemporaryDirectory(prefix=f"ranks-{world}-{device}-") as out:
        (Path(out) / "spec.json").write_text(json.dumps(spec))
        died = None
        try:
            env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")])}
            # As a module: run as a script, tests/ would lead sys.path and tests/reference shadow reference/.
            torchrun("tests.on_rank", world, f"{out}/spec.json", out, timeout=LAUNCH_TIMEOUT_S, env=env, module=True)
        except pytest.fail.Exception as failure:
            died = str(failure)
        found = {}
        for index, item in enumerate(items):
            files = [Path(out) / f"{index}.rank{r}" for r in range(world)]
            if all(Path(f"{f}.json").exists() for f in files):
                found[item.nodeid] = [{**json.loads(Path(f"{f}.json").read_text()), "log": _log(f)} for f in files]
            elif died:  # the test the launch died in: each rank's own log of it, then the launch's output
                message = f"the launch died in this test: {died}"
                found[item.nodeid] = [{"outcome": "failed", "message": message, "log": _log(f)} for f in files]
                break
    return found


def _log(result: Path) -> str:
    """The tail of what one rank printed during one test."""
    log = Path(f"{result}.log")
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


def _report(rank: int, result: dict) -> str:
    log = f"\n--- rank {rank} output ---\n{result['log']}" if result["log"] else ""
    return f"=== rank {rank} {result['outcome']} ===\n{result['message']}{log}"

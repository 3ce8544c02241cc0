"""Session-wide: the run fails if a process it started outlives it (a git daemon, a torchrun worker, a server);
and, under pytest-xdist (`make test` runs `-n 2`), tests that share state run in one worker.

Every process a session starts inherits SESSION_VARIABLE (tests/processes.py), so one left running is found
however it was started and whoever adopted it. It is named, then killed, so the next run starts clean. Under
xdist each worker is such a session and checks its own processes; the controller starts none, collects what
the workers found and fails the run naming them. A worker that crashed never checks: once the workers are
gone, the controller kills and names what still runs from any of them (RUN_VARIABLE).

Scheduling (pytest_xdist_make_scheduler, scope_of): the @on_ranks tests of one world run in one worker (they
share its launches: tests/ranks.py), as do the site tests (they build into the repository's docs/); other
tests go to the workers a module at a time.

Upstream evidence of torch (tests marked upstream("pytorch")) skips on any torch but the pinned one.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest

from tests.launch import PINNED_TORCH, on_pinned_torch
from tests.processes import RUN_VARIABLE, SESSION_VARIABLE, live_with_environment, new_session_token
from tests.ranks import launch_of

pytest_plugins = ["pytester"]  # tests/test_ranks.py runs the harness in a pytest of its own

GRACE_S = 5.0  # a process told to stop at the end of the last test may need a moment to exit


def _xdist_controller(config: pytest.Config) -> bool:
    """Is this the process that hands tests to xdist workers (`-n N`, N > 0)?"""
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


_LEAKED = pytest.StashKey[list]()  # the lines naming leaked processes, in the session that reports them


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_LEAKED] = []
    if _xdist_controller(config):
        os.environ[RUN_VARIABLE] = new_session_token()  # before xdist starts the workers, which inherit it
        config.pluginmanager.register(_CrashedWorkers(), "crashed-workers")
    else:
        os.environ[SESSION_VARIABLE] = new_session_token()


def scope_of(nodeid: str) -> str:
    """The unit xdist hands to one worker: the @on_ranks tests of one world and device (a worker launches once
    for all of them it collected; the launches of other worlds may run in the other worker), the site tests
    (they build into docs/), or else the test's module."""
    if launch := launch_of(nodeid):
        return f"@on_ranks[{launch}]"
    module = nodeid.split("::", 1)[0]  # parameter ids may hold "::"
    return "tests/site" if module.startswith("tests/site/") else module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that run torch's own FSDP1, DTensor or pipelining as the notes' evidence (upstream("pytorch")) skip
    on another torch: the notes cite the pinned torch's source, and another release may differ from it."""
    torchs = [i for i in items if any(mark.args[:1] == ("pytorch",) for mark in i.iter_markers("upstream"))]
    if not torchs or on_pinned_torch():
        return
    import torch  # loaded by on_pinned_torch

    skip = pytest.mark.skip(
        reason=f"upstream evidence of the cited torch {PINNED_TORCH} (constraints.txt); "
        f"torch {torch.__version__} is installed"
    )
    for item in torchs:
        item.add_marker(skip)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's load-by-scope scheduling, by scope_of."""
    from xdist.scheduler import LoadScopeScheduling

    class ByLaunch(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ByLaunch(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """A worker finished (xdist calls this in the controller): keep what its leak check found."""
    node.config.stash[_LEAKED] += getattr(node, "workeroutput", {}).get("leaked", [])


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session of its own, or an xdist worker (tryfirst: before xdist sends the worker's output home)."""
    config = session.config
    if _xdist_controller(config):
        return  # _CrashedWorkers reports, once the workers are gone
    leaked = _kill_leaked(SESSION_VARIABLE)
    if hasattr(config, "workeroutput"):  # an xdist worker: its controller reports them
        config.workeroutput["leaked"] = leaked
    elif leaked:
        _report(session, leaked)


class _CrashedWorkers:
    """In the controller, after xdist has ended its workers (trylast: xdist's own session end stops them):
    what the workers found, and what any worker started that still runs, which only a worker that crashed
    (and so never ran its own check) can have left."""

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        leaked = session.config.stash[_LEAKED] + _kill_leaked(RUN_VARIABLE)
        if leaked:
            _report(session, leaked)


def _report(session: pytest.Session, leaked: list[str]) -> None:
    """Name each leaked process in red and fail the run."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in leaked:
        if reporter is not None:
            reporter.write_line(line, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _kill_leaked(variable: str) -> list[str]:
    """Kill every process started with this session's `variable` that still runs; a line naming each."""
    token = os.environ[variable]
    # A GitPython Repo a test dropped ends its `git cat-file` helpers when it is finalized; reference cycles
    # keep some alive until the collector runs, so run it before looking.
    gc.collect()
    deadline = time.monotonic() + GRACE_S
    while (left := live_with_environment(variable, token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = []
    for process in left:
        lines.append(
            f"leaked process: pid {process.pid}: {process.command} (still running after the test session; killed now)"
        )
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return lines

"""Session-wide: the run fails if a process it started outlives it (a git daemon, a torchrun worker, a server).

Every process the session starts inherits SESSION_VARIABLE (tests/processes.py), so one left running is found
however it was started and whoever adopted it. It is named, then killed, so the next run starts clean.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest

from tests.processes import SESSION_VARIABLE, live_with_environment, new_session_token

GRACE_S = 5.0  # a process told to stop at the end of the last test may need a moment to exit


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SESSION_VARIABLE] = new_session_token()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    token = os.environ[SESSION_VARIABLE]
    # A GitPython Repo a test dropped ends its `git cat-file` helpers when it is finalized; reference cycles
    # keep some alive until the collector runs, so run it before looking.
    gc.collect()
    deadline = time.monotonic() + GRACE_S
    while (left := live_with_environment(SESSION_VARIABLE, token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for process in left:
        if reporter is not None:
            reporter.write_line(
                f"leaked process: pid {process.pid}: {process.command} (still running after the "
                "test session; killed now)",
                red=True,
            )
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED

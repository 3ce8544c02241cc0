"""No process outlives the test session: the git daemon's whole group ends with stop(), and the session-end
check (tests/conftest.py) fails a run that leaves one behind, naming it."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.gitserver import GitDaemon
from tests.launch import ROOT
from tests.processes import live_in_group, live_processes


def test_git_daemon_stop_ends_its_whole_process_group(tmp_path):
    daemon = GitDaemon(tmp_path)
    group = daemon.proc.pid
    commands = [p.command for p in live_in_group(group)]
    assert any("git-daemon" in c for c in commands), commands  # the child the `git daemon` wrapper forks
    daemon.stop()
    assert live_in_group(group) == []
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", daemon.port)) != 0  # nothing listens any more


def _pytest(tmp_path, source: str, *options: str) -> subprocess.CompletedProcess:
    """A pytest run of `source` (a test module) in its own folder, with this suite's session-end check."""
    (tmp_path / "test_leak.py").write_text(textwrap.dedent(source))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", *options]
        + ["--rootdir", str(tmp_path), str(tmp_path / "test_leak.py")],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _named_and_killed(run: subprocess.CompletedProcess, command: str) -> None:
    line = rf"leaked process: pid \d+: {re.escape(command)} \(still running after the test session; killed now\)"
    assert re.search(line, run.stdout), run.stdout + run.stderr
    assert not [p for p in live_processes() if p.command == command]  # killed by the check


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_a_run_that_leaks_a_process_fails_naming_it(tmp_path, workers):
    """Alone, or in an xdist worker (whose controller reports it), as `make test` runs."""
    run = _pytest(
        tmp_path,
        """
        import subprocess

        def test_starts_and_forgets():
            subprocess.Popen(["sleep", "137"], start_new_session=True)
        """,
        *workers,
    )
    assert run.returncode == 1 and "1 passed" in run.stdout, run.stdout + run.stderr
    _named_and_killed(run, "sleep 137")


def test_what_a_crashed_xdist_worker_started_is_found_by_the_controller(tmp_path):
    """A worker killed mid-test (out of memory, say) never runs its own check; the controller's finds its child."""
    run = _pytest(
        tmp_path,
        """
        import os, signal, subprocess

        def test_starts_then_dies():
            subprocess.Popen(["sleep", "139"], start_new_session=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """,
        "-n",
        "1",
        "--max-worker-restart",
        "0",
    )
    assert run.returncode == 1 and "crashed" in run.stdout, run.stdout + run.stderr
    _named_and_killed(run, "sleep 139")

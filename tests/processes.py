"""Processes as Linux's /proc shows them: what `GitDaemon.stop` waits on and the session-end leak check reads.

A process that outlives its parent is re-parented to init, so "started by this test session" cannot be read
from the process tree; it is read from the environment instead: the session sets SESSION_VARIABLE to a value
of its own (tests/conftest.py), and every process it starts inherits it, however far down. Under xdist the
controller sets RUN_VARIABLE as well, so what a crashed worker (no session end of its own) left is found too.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

SESSION_VARIABLE = "REFERENCE_TEST_SESSION"
RUN_VARIABLE = "REFERENCE_TEST_RUN"  # set by an xdist controller: its workers and all they start carry it


@dataclasses.dataclass(frozen=True)
class Process:
    pid: int
    pgid: int
    command: str


def new_session_token() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex}"


def live_processes() -> list[Process]:
    """Every process this user can read that has not exited (zombies, already dead, are left out)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        state, _ppid, pgid = stat.rsplit(")", 1)[1].split()[:3]  # the command name may hold spaces and ")"
        if state != "Z":
            found.append(Process(int(entry.name), int(pgid), command or stat.split("(", 1)[1].rsplit(")", 1)[0]))
    return found


def live_in_group(pgid: int) -> list[Process]:
    """The live members of process group `pgid`."""
    return [p for p in live_processes() if p.pgid == pgid]


def live_with_environment(variable: str, value: str) -> list[Process]:
    """Live processes, other than this one, started with `variable=value` in their environment."""
    needle = f"{variable}={value}".encode()
    found = []
    for process in live_processes():
        if process.pid == os.getpid():
            continue
        try:
            environment = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environment:
            found.append(process)
    return found

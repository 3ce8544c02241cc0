"""Processes as Linux's /proc shows them: what `GitDaemon.stop` waits on and the session-end leak check reads.

A process that outlives its parent is re-parented to init, so "started by this test session" cannot be read
from the process tree; it is read from the environment instead: the session sets SESSION_VARIABLE to a value
of its own (tests/conftest.py), and every process it starts inherits it, however far down. Under xdist the
controller sets RUN_VARIABLE as well, so what a crashed worker (no session end of its own) left is found too.
"""

from __future__ import annotations

import dataclasses
import os
import time
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
    """Live processes, other than this one, started with `variable=value` in their environment. A process inside
    execve, after its new memory replaced the old and before the new stack holds the environment, reads as
    empty while the parent that vfork released already runs on (a test that starts a process and ends at once):
    those are read again, together, for up to MID_EXEC_S."""
    needle = f"{variable}={value}".encode()
    unread = [p for p in live_processes() if p.pid != os.getpid()]
    found, deadline = [], time.monotonic() + MID_EXEC_S
    while unread:
        empty = []
        for process in unread:
            environment = _environment(process.pid)
            if environment is None:
                empty.append(process)
            elif needle in environment:
                found.append(process)
        if not empty or time.monotonic() > deadline:
            break
        unread = empty
        time.sleep(0.01)
    return found


PF_KTHREAD = 0x00200000  # /proc/PID/stat's flags: a kernel thread, whose environment is always empty
MID_EXEC_S = 1.0


def _environment(pid: int) -> list[bytes] | None:
    """The process's environment; [] if it exited or is not ours to read, None while it reads as empty."""
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
        if not data and not _kernel_thread(pid):
            return None
    except OSError:
        return []
    return data.split(b"\0")


def _kernel_thread(pid: int) -> bool:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return bool(int(fields[6]) & PF_KTHREAD)  # fields from the state (stat's third) on: flags is the ninth

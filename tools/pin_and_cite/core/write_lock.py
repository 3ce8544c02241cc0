"""The lock every run that writes the project holds, in the project itself (reading_notes/.pin-and-cite.lock,
ignored by git): two runs with different caches still take turns, and a journal is only recovered by a run
holding it. The holder writes its pid and command into the lock file, so a run that waits for it says, once and
after a short turn, whom it waits for and how to stop waiting: a holder stopped with SIGSTOP once made the next
`render` wait in silence. The lock is flock(2) on that file, as the filelock package takes it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pin_and_cite.core.errors import PinAndCiteError, printable
from pin_and_cite.core.project import NOTES_DIR, refuse_special_files

WRITE_LOCK = ".pin-and-cite.lock"  # in NOTES_DIR, ignored by git
QUIET_WAIT_S = 1.0  # a turn shorter than this is not worth a line
POLL_S = 0.05
MAX_RECORD_BYTES = 1024  # what a waiter reads of the holder's pid and command
MAX_SHOWN_COMMAND = 200


@contextlib.contextmanager
def write_lock(root: Path) -> Iterator[None]:
    """Hold the project's write lock for the block, waiting (and saying for whom) while another run holds it."""
    notes_dir = root / NOTES_DIR
    refuse_special_files(notes_dir)  # before the lock file is opened through a planted symlink
    lock = notes_dir / WRITE_LOCK
    if lock.is_dir():
        raise PinAndCiteError(f"{lock} is a folder; remove it (it is the file runs that write the project lock)")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        _acquire(fd, lock)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {_command()}\n".encode(errors="backslashreplace"), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # a later holder that records nothing is not taken for this one
    finally:
        os.close(fd)  # releases the lock


def _command() -> str:
    """The holder's program and verb, for the waiter's line; not its other arguments (a --url may hold a token,
    and the lock file is readable by whoever can read the project)."""
    program = Path(sys.argv[0])
    return shlex.join([program.parent.name if program.name == "__main__.py" else program.name, *sys.argv[1:2]])


def _acquire(fd: int, lock: Path) -> None:
    deadline = time.monotonic() + QUIET_WAIT_S
    while not _try_lock(fd):
        if time.monotonic() >= deadline:
            print(f"pin-and-cite: {printable(waiting_line(lock, os.pread(fd, MAX_RECORD_BYTES, 0)))}", file=sys.stderr)
            sys.stderr.flush()
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        time.sleep(POLL_S)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def waiting_line(lock: Path, record: bytes) -> str:
    """What a waiter says of the holder its lock file records (`PID COMMAND`), or of one that recorded nothing."""
    pid, _, command = record.decode("utf-8", "backslashreplace").strip().partition(" ")
    stop = "Ctrl-C stops waiting (nothing was written yet)"
    if not pid.isdigit():
        return f"waiting for {lock}, held by a process that did not record itself (`fuser {lock}` names it); {stop}"
    if len(command) > MAX_SHOWN_COMMAND:
        command = command[:MAX_SHOWN_COMMAND] + "..."
    return (
        f"waiting for {lock}, held by pid {pid} ({command}); {stop}; if that process is stopped, "
        f"`kill -CONT {pid}` resumes it"
    )

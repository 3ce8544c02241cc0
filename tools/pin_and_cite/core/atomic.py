"""Write-then-rename, so a reader or a crash never sees half a file. Several files replaced as one step go
through pin_and_cite.relocation.journal, which builds on these primitives."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        _fill(fd, path, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def stage(tmp: Path, target: Path, data: bytes) -> None:
    """Create `tmp` (it must not exist) holding `data`, synced, with the mode `target` has or would get."""
    _fill(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), target, data)


def _fill(fd: int, target: Path, data: bytes) -> None:
    os.fchmod(fd, _mode_for(target))
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def sync_directory(directory: Path) -> None:
    """Make the renames in `directory` durable (a rename is only on disk once its directory is synced)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mode_for(path: Path) -> int:
    """The file's current mode, or the one open() would give a new file: mkstemp's 0600 would make pins,
    the lock, rewritten notes and served site files private to whoever last wrote them."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def no_interrupts():
    """Hold SIGINT/SIGTERM until the block is done (they are delivered right after), where POSIX allows."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)

"""Write-then-rename, so a reader or a crash never sees half a file; a set of files is staged completely
before any of them is replaced, so a failed step (disk full, Ctrl-C) leaves the whole set as it was."""
from __future__ import annotations

import contextlib
import os
import signal
import stat
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_all({path: data})


def atomic_write_all(files: dict[Path, bytes]) -> None:
    """Write several files as one step: stage every one first, and only when all are staged rename them into
    place; a failure while staging (disk full, permissions) leaves every file as it was."""
    staged: list[tuple[str, Path]] = []
    try:
        for path, data in files.items():
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            staged.append((tmp, path))
            os.fchmod(fd, _mode_for(path))
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
    except BaseException:
        for tmp, _ in staged:
            os.unlink(tmp)
        raise
    with _no_interrupts():                        # Ctrl-C cannot land between two renames
        for tmp, path in staged:
            os.replace(tmp, path)


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
def _no_interrupts():
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

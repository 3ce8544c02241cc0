"""Read a file someone else may have planted (a cache entry, a page in the output folder) without following
it anywhere: never through a symlink, never a FIFO (which would block), a device (/dev/zero never ends) or a
directory, and never more bytes than the caller can use."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pin_and_cite.core.errors import PinAndCiteError

MAX_CODE_BYTES = 8 << 20  # a Python file of the project larger than this is not code anyone reads

KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegularFile(PinAndCiteError):
    """The path exists but is not a plain file."""


def read_regular(path: Path, limit: int) -> bytes | None:
    """At most `limit + 1` bytes of the regular file `path` (so a caller sees that it is too large without
    reading it all), or None when nothing is there; NotRegularFile for anything else."""
    try:  # O_NONBLOCK: opening a FIFO must not wait
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: the last component is a symlink
        kind = "a symlink" if path.is_symlink() else exc.strerror
        raise NotRegularFile(f"{path} is {kind}, not a regular file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in KINDS if test(mode)), "special")
        raise NotRegularFile(f"{path} is {kind}, not a regular file")
    with os.fdopen(fd, "rb") as file:
        return file.read(limit + 1)


def read_in_project(root: Path, path: Path, limit: int) -> bytes:
    """The bytes of `path`, a regular file under `root` reached through no symlink (a branch's `reference -> /`
    or `reference/x.py -> ~/.ssh/id_rsa` would otherwise be read as the project's code); at most `limit`."""
    for folder in [path, *path.parents]:
        if folder == root:
            break
        if folder.is_symlink():
            raise PinAndCiteError(f"{folder} is a symlink; the project's code is read from plain files only")
    data = read_regular(path, limit)
    if data is None:
        raise PinAndCiteError(f"{path} does not exist")
    if len(data) > limit:
        raise PinAndCiteError(f"{path} is larger than {limit} bytes")
    return data

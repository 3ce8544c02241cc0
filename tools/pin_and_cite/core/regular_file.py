"""Read a file someone else may have planted (a cache entry, a page in the output folder) without following
it anywhere: never through a symlink, never a FIFO (which would block), a device (/dev/zero never ends) or a
directory, and never more bytes than the caller can use."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pin_and_cite.core.errors import PinAndCiteError

MAX_CODE_BYTES = 8 << 20  # a Python file of the project larger than this is not code anyone reads
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: opening a FIFO must not wait
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

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
    try:
        fd = os.open(path, FILE_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: the last component is a symlink
        raise _not_regular(path, exc) from None
    return _read(fd, path, limit)


def read_beneath(folder: Path, path: Path, limit: int) -> bytes | None:
    """As read_regular, for `path` under `folder`, through one descriptor opened a component at a time from
    `folder`, none followed as a symlink: what is checked is what is read (a template swapped for a symlink
    after reading_notes/ was checked once put an outside file on a page)."""
    parts = path.relative_to(folder).parts
    if not parts or ".." in parts:
        raise NotRegularFile(f"{path} is not a file under {folder}")
    try:
        fd = os.open(folder, FOLDER_FLAGS)
    except OSError as exc:
        raise _not_regular(folder, exc) from None
    reached = folder
    try:
        for part in parts[:-1]:
            reached = reached / part
            inner = os.open(part, FOLDER_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = inner
        reached = path
        file_fd = os.open(parts[-1], FILE_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP or ENOTDIR: a symlink on the way
        raise _not_regular(reached, exc) from None
    finally:
        os.close(fd)
    return _read(file_fd, path, limit)


def _not_regular(path: Path, exc: OSError) -> NotRegularFile:
    kind = "a symlink" if path.is_symlink() else exc.strerror
    return NotRegularFile(f"{path} is {kind}, not a regular file")


def _read(fd: int, path: Path, limit: int) -> bytes:
    """At most `limit + 1` bytes of the opened `fd`, refused (and closed) unless it is a regular file. It asks
    for the size fstat gives (asking for `limit + 1` made Python allocate that much for every read, as much
    time as reading a template), and reads on towards the limit only if the file grew since."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = next((name for test, name in KINDS if test(info.st_mode)), "special")
        raise NotRegularFile(f"{path} is {kind}, not a regular file")
    with os.fdopen(fd, "rb") as file:
        data = file.read(min(info.st_size, limit) + 1)
        if info.st_size < len(data) <= limit:
            data += file.read(limit + 1 - len(data))
        return data


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

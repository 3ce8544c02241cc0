"""Several files replaced as one step, even across a SIGKILL or a power cut, the way a database commits.

`write_all` first records in a journal (in the directory that holds the files) the staged name of every
file, then stages them all, then marks the journal committed, and only then renames them into place. A run
that dies before the commit mark is rolled back by `recover` (the staged files are removed); one that dies
after it is rolled forward (the remaining renames are done). The journal itself is replaced by rename, so it
is either absent or whole. `recover` runs when the next pin-and-cite verb opens the project, under the
project lock, so it never races a live writer.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
from pathlib import Path

import filelock

from pin_and_cite.core.atomic import no_interrupts, stage, sync_directory
from pin_and_cite.core.errors import PinAndCiteError

NAME = ".pin-and-cite-journal.json"
KILL_AT_RENAME = "PIN_AND_CITE_TEST_KILL_AT_RENAME"  # tests: SIGKILL this process just before rename N (0-based)
_STAGED = re.compile(r"\.(.+)\.[0-9a-f]{8}\.tmp")  # the staged name of `name`: .name.XXXXXXXX.tmp


def write_all(files: dict[Path, bytes], directory: Path) -> None:
    """Replace every file (each under `directory`) with its bytes, all or none; a failure while staging
    (disk full, Ctrl-C) leaves every file as it was."""
    journal = directory / NAME
    tag = secrets.token_hex(4)
    pairs = [(target.with_name(f".{target.name}.{tag}.tmp"), target) for target in files]
    renames = _Renames()
    try:
        _save(journal, "staging", pairs, directory, renames)
        for tmp, target in pairs:
            stage(tmp, target, files[target])
        _save(journal, "committed", pairs, directory, renames)  # the commit point
    except BaseException:
        _roll_back(journal, pairs)
        raise
    with no_interrupts():  # Ctrl-C cannot land between two renames
        _roll_forward(journal, pairs, renames)


def recover(directory: Path, lock: filelock.BaseFileLock) -> str | None:
    """Finish or undo a `write_all` in `directory` that was killed; say which, or None when there was none.
    `lock` is the one writers hold, so a live write is never taken for a dead one."""
    journal = directory / NAME
    if not journal.exists() and not journal.with_name(f"{NAME}.tmp").exists():
        return None
    with lock:
        return _recover(directory, journal)


def _recover(directory: Path, journal: Path) -> str | None:
    try:
        record = json.loads(journal.read_bytes())
        state = record["state"]
        pairs = [_inside(directory, tmp, target) for tmp, target in record["files"]]
    except FileNotFoundError:  # killed while writing the journal: nothing staged yet
        journal.with_name(f"{NAME}.tmp").unlink(missing_ok=True)
        return None
    except (ValueError, KeyError, TypeError) as exc:
        raise PinAndCiteError(f"{journal} is not a pin-and-cite journal ({exc}); inspect it, then remove it") from None
    if state == "committed":
        _roll_forward(journal, pairs, _Renames())
        return f"completed an interrupted write of {len(pairs)} file(s) in {directory}"
    _roll_back(journal, pairs)
    return f"rolled back an interrupted write of {len(pairs)} file(s) in {directory}"


class _Renames:
    """Counts this write's renames, for the test hook that kills the process at one of them."""

    def __init__(self):
        self.done = 0
        self.kill_at = int(os.environ.get(KILL_AT_RENAME, "-1"))

    def __call__(self, src: Path, dst: Path) -> None:
        if self.done == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.done += 1
        os.replace(src, dst)


def _save(journal: Path, state: str, pairs: list[tuple[Path, Path]], directory: Path, rename: _Renames) -> None:
    tmp = journal.with_name(f"{NAME}.tmp")
    files = [[str(p.relative_to(directory)) for p in pair] for pair in pairs]
    stage(tmp, journal, json.dumps({"state": state, "files": files}).encode())
    rename(tmp, journal)
    sync_directory(directory)


def _roll_forward(journal: Path, pairs: list[tuple[Path, Path]], rename: _Renames) -> None:
    for tmp, target in pairs:
        if tmp.exists():  # else renamed before the interruption
            rename(tmp, target)
    for directory in {target.parent for _, target in pairs}:
        sync_directory(directory)
    journal.unlink()


def _roll_back(journal: Path, pairs: list[tuple[Path, Path]]) -> None:
    for tmp in [tmp for tmp, _ in pairs] + [journal.with_name(f"{NAME}.tmp"), journal]:
        tmp.unlink(missing_ok=True)


def _inside(directory: Path, tmp: str, target: str) -> tuple[Path, Path]:
    """A journal entry as paths, refused unless both stay inside `directory` and `tmp` is `target`'s staged
    name (a journal committed to a branch must not move or remove anything else)."""
    tmp_path, target_path = directory / tmp, directory / target
    root = directory.resolve()
    match = _STAGED.fullmatch(tmp_path.name)
    if (
        not match
        or match[1] != target_path.name
        or tmp_path.parent != target_path.parent
        or not target_path.resolve().is_relative_to(root)
        or ".." in Path(target).parts
    ):
        raise ValueError(f"entry {tmp!r} -> {target!r} is not a staged file of the project")
    return tmp_path, target_path

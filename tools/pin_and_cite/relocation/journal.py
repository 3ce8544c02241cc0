"""Several files replaced as one step, even across a SIGKILL or a power cut, the way a database commits.

`write_all` first records in a journal (in the directory that holds the files) the staged name and SHA-256 of
every file, then stages them all, then marks the journal committed, and only then renames them into place. A
run that dies before the commit mark is rolled back by `recover` (the staged files are removed); one that dies
after it is rolled forward (the remaining renames are done; a staged file that is gone must have reached its
target, by its hash, or the roll forward stops loudly). Only a verb that writes the project recovers, holding
the project's write lock (pin_and_cite.core.write_lock); read-only verbs refuse while `pending`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import signal
import stat
from pathlib import Path

from pin_and_cite.core.atomic import no_interrupts, stage, sync_directory
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.regular_file import read_regular

NAME = ".pin-and-cite-journal.json"
MAX_JOURNAL_BYTES = 1 << 20  # a journal names a few files: more is not one of ours
KILL_AT_RENAME = "PIN_AND_CITE_TEST_KILL_AT_RENAME"  # tests: SIGKILL this process just before rename N (0-based)
_STAGED = re.compile(r"\.(.+)\.[0-9a-f]{8}\.tmp")  # the staged name of `name`: .name.XXXXXXXX.tmp
_SHA256 = re.compile(r"[0-9a-f]{64}")

Entry = tuple[Path, Path, str]  # staged file, target, SHA-256 of the staged bytes


def write_all(files: dict[Path, bytes], directory: Path) -> None:
    """Replace every file (each under `directory`) with its bytes, all or none; a failure while staging
    (disk full, Ctrl-C) leaves every file as it was."""
    journal = directory / NAME
    tag = secrets.token_hex(4)
    entries = [
        (target.with_name(f".{target.name}.{tag}.tmp"), target, hashlib.sha256(data).hexdigest())
        for target, data in files.items()
    ]
    renames = _Renames()
    try:
        _save(journal, "staging", entries, directory, renames)
        for tmp, target, _ in entries:
            stage(tmp, target, files[target])
        _save(journal, "committed", entries, directory, renames)  # the commit point
    except BaseException:
        _roll_back(journal, entries)
        raise
    with no_interrupts():  # Ctrl-C cannot land between two renames
        _roll_forward(journal, entries, renames)


def pending(directory: Path) -> bool:
    """Whether `directory` holds a journal (or half of one), without opening it."""
    return any(os.path.lexists(directory / name) for name in (NAME, f"{NAME}.tmp"))


def refuse_pending(directory: Path, verb: str) -> None:
    """Stop a run that must not recover a journal (a read-only verb, the site build) while one is pending,
    naming the verb that finishes or undoes it."""
    if pending(directory):
        raise PinAndCiteError(
            f"{directory} holds an interrupted write ({NAME}); run `tools/pin-and-cite render` to finish or "
            f"undo it, then {verb} again"
        )


def recover(directory: Path) -> str | None:
    """Finish or undo a `write_all` in `directory` that was killed; say which, or None when there was none.
    The caller holds the project's write lock, so a live write is never taken for a dead one."""
    journal = directory / NAME
    if not pending(directory):
        return None
    try:
        data = read_regular(journal, MAX_JOURNAL_BYTES)
        if data is None:  # killed while writing the journal: nothing staged yet
            _unlink_regular(journal.with_name(f"{NAME}.tmp"))
            return None
        if len(data) > MAX_JOURNAL_BYTES:
            raise ValueError(f"more than {MAX_JOURNAL_BYTES} bytes")
        record = json.loads(data)
        state = record["state"]
        entries = [_inside(directory, entry) for entry in record["files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise PinAndCiteError(f"{journal} is not a pin-and-cite journal ({exc}); inspect it, then remove it") from None
    if state == "committed":
        _roll_forward(journal, entries, _Renames())
        return f"completed an interrupted write of {len(entries)} file(s) in {directory}"
    _roll_back(journal, entries)
    return f"rolled back an interrupted write of {len(entries)} file(s) in {directory}"


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


def _save(journal: Path, state: str, entries: list[Entry], directory: Path, rename: _Renames) -> None:
    tmp = journal.with_name(f"{NAME}.tmp")
    files = [[str(staged.relative_to(directory)), str(to.relative_to(directory)), sha] for staged, to, sha in entries]
    stage(tmp, journal, json.dumps({"state": state, "files": files}).encode())
    rename(tmp, journal)
    sync_directory(directory)


def _roll_forward(journal: Path, entries: list[Entry], rename: _Renames) -> None:
    for tmp, target, sha in entries:
        if _is_regular(tmp):
            rename(tmp, target)
        elif not (_is_regular(target) and hashlib.sha256(target.read_bytes()).hexdigest() == sha):
            raise PinAndCiteError(
                f"{tmp} is gone and {target} does not hold what the journal {journal} staged (another process "
                "disturbed the write); restore reading_notes/ from git, remove the journal, and run the verb again"
            )
    for directory in {target.parent for _, target, _ in entries}:
        sync_directory(directory)
    journal.unlink()


def _roll_back(journal: Path, entries: list[Entry]) -> None:
    for tmp in [tmp for tmp, _, _ in entries] + [journal.with_name(f"{NAME}.tmp"), journal]:
        _unlink_regular(tmp)


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except FileNotFoundError:
        return False


def _unlink_regular(path: Path) -> None:
    """Remove a staged file or the journal; anything else planted under its name is refused, never removed."""
    if os.path.lexists(path) and not _is_regular(path):
        raise PinAndCiteError(f"{path} is not a regular file; inspect it, then remove it")
    path.unlink(missing_ok=True)


def _inside(directory: Path, entry) -> Entry:
    """A journal entry ([staged, target, SHA-256]) as paths, refused unless both stay inside `directory`,
    the first is the target's staged name, and neither is anything but a regular file (a journal committed to
    a branch must not move or remove anything else, nor swap a symlink or a FIFO in)."""
    if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(part, str) for part in entry)):
        raise ValueError(f"entry {str(entry)[:200]} is not [staged file, target, SHA-256]")
    tmp, target, sha = entry
    tmp_path, target_path = directory / tmp, directory / target
    root = directory.resolve()
    match = _STAGED.fullmatch(tmp_path.name)
    if (
        not match
        or match[1] != target_path.name
        or tmp_path.parent != target_path.parent
        or not target_path.resolve().is_relative_to(root)
        or ".." in Path(target).parts
        or not _SHA256.fullmatch(sha)
    ):
        raise ValueError(f"entry {tmp!r} -> {target!r} is not a staged file of the project")
    for path in (tmp_path, target_path):
        if os.path.lexists(path) and not _is_regular(path):
            raise ValueError(f"{path.name} is not a regular file")
    return tmp_path, target_path, sha

"""The folder `render` writes pages into, and the record of which pages there are its own.

`render --out DIR` removes the pages it no longer makes, so it must know which pages it made: DIR/MANIFEST
lists them (mkdocs skips dot-files). Only those are ever removed. A folder holding Markdown that render did
not write (README.md when DIR is the project, someone's own page, a file committed on a branch) is refused
before anything is written; a page that already says exactly what render would write is taken as its own
(an older render's output). The project's own site folder (docs/notes, build output git ignores) rendered by a
version without the manifest also holds render's pages at the paths render writes: there, and only while no
manifest exists yet, those are taken as its own too. Nothing is written or removed outside DIR: DIR itself a
symlink, or a page whose folder is one leading elsewhere, is refused, and existing pages are read as regular
files only. Renders into one DIR take turns, and a killed render's pages are listed before they are written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path, PurePosixPath

from pin_and_cite.core.atomic import atomic_write
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.regular_file import read_regular

MANIFEST = ".pin-and-cite-pages.json"
SHOWN = 3  # foreign pages named in the refusal


class OutputFolder:
    def __init__(self, root: Path, adopt_legacy_pages: bool = False):
        self.root = root
        self.manifest = root / MANIFEST
        self.adopt_legacy_pages = adopt_legacy_pages

    def _load_manifest(self) -> set[str]:
        try:
            data = read_regular(self.manifest, 16 << 20)
            listed = json.loads(data) if data is not None else []
        except (ValueError, PinAndCiteError) as exc:
            raise PinAndCiteError(f"{self.manifest} cannot be read ({exc}); delete it and the pages it lists") from None
        if not isinstance(listed, list) or not all(isinstance(p, str) and _is_page(p) for p in listed):
            raise PinAndCiteError(
                f"{self.manifest} must list pages under {self.root} (relative *.md paths); "
                "delete it and the pages it lists"
            )
        return set(listed)

    def write(self, pages: dict[str, str], remove_stale: bool = True) -> list[Path]:
        """Make the folder hold exactly `pages` (relative path -> Markdown) among the pages render owns:
        write those whose text differs, remove owned pages no longer made (unless not `remove_stale`: a render
        that could not make every page keeps the others as they were), then record the new set. The files
        written or removed are returned. Renders into one folder take turns (a lock on the folder itself), and
        the manifest lists every page before it is written, so a killed render's pages are render's own to the
        next one."""
        with _locked_folder(self.root):
            return self._write(pages, remove_stale)

    def _write(self, pages: dict[str, str], remove_stale: bool) -> list[Path]:
        adopt_legacy_pages = self.adopt_legacy_pages and not self.manifest.exists()
        owned = self._load_manifest()
        for name in set(pages) | owned:
            self._refuse_outside(name)
        same = {
            name for name, text in pages.items() if read_regular(self.root / name, len(text.encode())) == text.encode()
        }
        legacy = (
            {name for name in pages if (self.root / name).is_file() and not (self.root / name).is_symlink()}
            if adopt_legacy_pages
            else set()
        )  # an older render of the site folder, before the manifest
        foreign = sorted(self._markdown() - owned - same - legacy)
        if foreign:
            shown = ", ".join(foreign[:SHOWN]) + (f" and {len(foreign) - SHOWN} more" if len(foreign) > SHOWN else "")
            raise PinAndCiteError(
                f"{self.root} holds Markdown that render did not write ({shown}); render into "
                "a folder of its own, or move those files away"
            )
        if not set(pages) <= owned:  # claimed before written
            self._record(owned | set(pages))
        changed = []
        for name in sorted(set(pages) - same):
            atomic_write(self.root / name, pages[name].encode())
            changed.append(self.root / name)
        if not remove_stale:
            pages = {**dict.fromkeys(owned), **pages}  # listed, neither written nor removed
        for name in sorted(owned - set(pages)):
            stale = self.root / name
            if stale.is_symlink() or stale.is_file():
                stale.unlink()
                changed.append(stale)
                self._remove_empty_folders(stale.parent)
        if set(pages) != owned or not self.manifest.exists():
            self._record(set(pages))
        return changed

    def _record(self, names: set[str]) -> None:
        atomic_write(self.manifest, (json.dumps(sorted(names), indent=1) + "\n").encode())

    def _remove_empty_folders(self, folder: Path) -> None:
        """A removed page's folders go with it once empty (tests/x/ after tests/x/y.md); never the root, nor
        a symlink to a folder (_refuse_outside lets one that stays inside the root be written through)."""
        while folder != self.root and not folder.is_symlink() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent

    def _refuse_outside(self, name: str) -> None:
        """Refuse a page whose folder resolves outside the output folder (a symlinked folder)."""
        folder = (self.root / name).parent
        if not folder.resolve().is_relative_to(self.root.resolve()):
            raise PinAndCiteError(f"{folder} leads outside {self.root} (a symlink?); render writes only inside it")

    def _markdown(self) -> set[str]:
        """Every *.md under the folder, symlinks included, without following symlinked folders."""
        found = set()
        for folder, _, files in os.walk(self.root):
            found |= {(Path(folder) / f).relative_to(self.root).as_posix() for f in files if f.endswith(".md")}
        return found


def refuse_symlinked(out: Path, project_root: Path) -> None:
    """`render --out DIR` must not be a symlink, nor lead out of the project through one when DIR is inside it
    (docs/notes with docs/ a symlink): render writes only where the folder named is."""
    inside = out.is_relative_to(project_root)
    folders = [out, *out.parents] if inside else [out]
    for folder in folders:
        if inside and folder == project_root:
            break
        if folder.is_symlink():
            raise PinAndCiteError(f"{folder} is a symlink; render writes only into a plain folder")


@contextlib.contextmanager
def _locked_folder(root: Path):
    """An exclusive lock on the folder itself (flock on its descriptor: no lock file to plant or leave behind)."""
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        kind = "a symlink" if root.is_symlink() else "not a folder"
        raise PinAndCiteError(f"{root} is {kind}; render writes only into a plain folder")
    root.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PinAndCiteError(f"{root} is not a plain folder ({exc.strerror}); render writes only into one") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _is_page(name: str) -> bool:
    path = PurePosixPath(name)
    return name.endswith(".md") and not path.is_absolute() and ".." not in path.parts and "\\" not in name

"""The context one run (a `check`, a `render`, a site build) reads the checkout in: its root and the parse cache
the run shares. Every reader of the checkout (ours(), mirrors(), verified_by(), a note's written calls, a site's
note rules) takes it, so the cache is made once, by the run, and handed on as one thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pin_and_cite.core.parse_cache import ParseCache
from pin_and_cite.core.project import NOTES_DIR


@dataclass(frozen=True)
class Context:
    root: Path
    parsed: ParseCache | None = None  # None: read afresh (a test's scratch checkout); a run passes its resolver's

    @property
    def notes_dir(self) -> Path:
        return self.root / NOTES_DIR

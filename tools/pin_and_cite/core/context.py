"""What one run (a `check`, a `render`, a site build) reads the checkout with: its root and the run's parse cache,
handed as one thing to every reader of the checkout (ours, mirrors, verified_by, written calls, note rules)."""

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

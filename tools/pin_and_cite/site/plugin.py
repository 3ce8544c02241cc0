"""Where a site registers what its notes use beyond the tool's own globals, so that the tool names no subject.

reading_notes/pins.toml names it (`[site] plugin = "MODULE"`), a module shipped beside pin_and_cite: a checkout
under `check` chooses among the tool's modules, never its own code. MODULE's `PLUGIN` gives template globals for
one run, the rules each note keeps (before a page renders, and in `check`) and `new-note`'s skeleton.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pin_and_cite.core.context import Context
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.project import Project

SHIPPED_BESIDE = Path(__file__).resolve().parents[2]  # the folder holding pin_and_cite
MODULE_NAME = re.compile(r"[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*")


@dataclass(frozen=True)
class RuleProblem:  # a rule a note template breaks, at its line
    line: int
    message: str


@dataclass(frozen=True)
class Plugin:
    helpers: Callable[[Context], dict] = lambda context: {}  # extra template globals, for one run
    note_rules: Callable[[Path, Context], list[RuleProblem]] = lambda template, context: []
    skeleton: Callable[[str], str] | None = None  # a new note's text from its title, for `new-note`


def load_plugin(project: Project) -> Plugin:
    """The `PLUGIN` of the module pins.toml names (the tool's globals alone and no note rules when it names none)."""
    name = project.pins.plugin
    if name is None:
        return Plugin()
    where = f"{project.pins.path.name} [site] plugin {name[:80]!r}"
    top = name.split(".")[0]
    if not MODULE_NAME.fullmatch(name) or importlib.machinery.PathFinder.find_spec(top, [str(SHIPPED_BESIDE)]) is None:
        raise PinAndCiteError(f"{where}: no such module beside pin_and_cite in {SHIPPED_BESIDE}")
    module = importlib.import_module(name)
    if not Path(module.__file__ or "").resolve().is_relative_to(SHIPPED_BESIDE / top):
        raise PinAndCiteError(f"{where}: imported from {module.__file__}, not from {SHIPPED_BESIDE}")
    plugin = getattr(module, "PLUGIN", None)
    if not isinstance(plugin, Plugin):
        raise PinAndCiteError(f"{where}: the module has no PLUGIN (a pin_and_cite.site.plugin.Plugin)")
    return plugin

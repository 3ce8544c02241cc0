"""Find the citations written in the note templates, with the file and line where each is written.

Templates are parsed with Jinja's own parser, so a `cite("...")` call is found wherever Jinja would run it
(and only there), with the line number Jinja reports.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2
from jinja2 import nodes

from pin_and_cite.errors import PinAndCiteError

TEMPLATE_GLOB = "**/*.md.j2"


@dataclass(frozen=True)
class Written:
    """One call written in a template: `cite("SPEC")` at file:line."""
    function: str
    argument: str
    file: Path
    line: int

    def where(self, root: Path) -> str:
        return f"{self.file.relative_to(root)}:{self.line}"


def calls_in(template: Path, functions: set[str]) -> list[Written]:
    env = jinja2.Environment()
    try:
        tree = env.parse(template.read_text(), name=template.name, filename=str(template))
    except jinja2.TemplateSyntaxError as exc:
        raise PinAndCiteError(f"{template}:{exc.lineno}: template syntax error: {exc.message}") from None
    found = []
    for call in tree.find_all(nodes.Call):
        if isinstance(call.node, nodes.Name) and call.node.name in functions:
            arg = call.args[0] if call.args else None
            if not isinstance(arg, nodes.Const) or not isinstance(arg.value, str):
                raise PinAndCiteError(f"{template}:{call.lineno}: {call.node.name}() takes a literal string")
            found.append(Written(call.node.name, arg.value, template, call.lineno))
    return found


def note_templates(notes_dir: Path) -> list[Path]:
    """Every template that becomes a page of its own (partials, named `_*.md.j2`, are rendered by others)."""
    return sorted(t for t in notes_dir.glob(TEMPLATE_GLOB) if not t.name.startswith("_"))


def written_calls(notes_dir: Path, functions: set[str]) -> list[Written]:
    return [w for template in sorted(notes_dir.glob(TEMPLATE_GLOB)) for w in calls_in(template, functions)]

"""Find the citations written in the note templates, with the file and line where each is written.

Templates are parsed with Jinja's own parser, in the environment render uses (pin_and_cite.sandbox), so a
`cite("...")` call is found wherever Jinja would run it (and only there), with the line number Jinja reports.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import jinja2
from jinja2 import nodes

from pin_and_cite import sandbox
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
    try:
        tree = sandbox.environment().parse(template.read_text(), name=template.name, filename=str(template))
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


def rewrite_arguments(template: Path, changes: list[tuple[Written, str]]) -> bytes:
    """The template's bytes with the string literal of each written call replaced by a new argument, and
    every other byte (quotes, spacing, line endings, the rest of the note) exactly as it was."""
    text = template.read_bytes().decode("utf-8")
    line_starts = [0] + [m.end() for m in re.finditer(r"\r\n|\r|\n", text)]   # as Jinja counts lines
    edits: dict[int, tuple[int, str]] = {}
    for call, argument in sorted(changes, key=lambda change: change[0].line):
        literal = re.compile(r"""(['"])""" + re.escape(call.argument) + r"\1")
        match = literal.search(text, line_starts[call.line - 1])
        while match and match.start() in edits:            # the same citation twice: take the next one
            match = literal.search(text, match.start() + 1)
        if match is None:
            raise PinAndCiteError(f"{template}:{call.line}: cannot find the literal {call.argument!r} to rewrite")
        edits[match.start()] = (match.end(), match[1] + argument + match[1])
    for start in sorted(edits, reverse=True):
        end, replacement = edits[start]
        text = text[:start] + replacement + text[end:]
    return text.encode("utf-8")

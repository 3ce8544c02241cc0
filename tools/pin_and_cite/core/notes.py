"""Find the citations written in the note templates, with the file and line where each is written.

Templates are parsed with Jinja's own parser, in the environment render uses (pin_and_cite.core.sandbox), so a
`cite("...")` call is found wherever Jinja would run it (and only there), with the line number Jinja reports.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import jinja2
from jinja2 import nodes

from pin_and_cite.core import sandbox
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.gitobj import blob_sha
from pin_and_cite.core.project import MAX_NOTES_FILE
from pin_and_cite.core.regular_file import read_beneath

if TYPE_CHECKING:
    from pin_and_cite.core.context import Context

TEMPLATE_GLOB = "**/*.md.j2"
HIGHLIGHT = "highlight"
MAX_TEMPLATES = 1000  # templates in one project; each is at most MAX_NOTES_FILE (pin_and_cite.core.project)


@dataclass(frozen=True)
class Written:
    """One call written in a template: `cite("SPEC")` at file:line, with its `highlight="Lx-Ly"` if any (`more`:
    its further literal arguments, such as default()'s parameter name)."""

    function: str
    argument: str
    file: Path
    line: int
    highlight: str | None = None
    more: tuple[str, ...] = ()

    def where(self, root: Path) -> str:
        return f"{_relative(self.file, root)}:{self.line}"


@functools.cache
def _relative(file: Path, root: Path) -> Path:
    """`file` below `root`, once per file: `check` names hundreds of calls in a few dozen templates."""
    return file.relative_to(root)


def calls_in(template: Path, functions: set[str], context: Context | None = None) -> list[Written]:
    """The calls of `functions` written in `template`; the context's parse cache keeps what Jinja's parser
    found, by the hash of the template's text (a third of a `check` is parsing templates)."""
    text = template_text(template, context.notes_dir if context else None)
    parsed = context.parsed if context else None
    if parsed is None:
        every = _every_call(text, template)
    else:
        every = parsed.get(
            blob_sha(text.encode()),
            f"template calls, Jinja {jinja2.__version__}",
            lambda: _every_call(text, template),
            lambda found: [_Call(*c) for c in found],
        )
    found = []
    for call in every:
        if call.function not in functions:
            continue
        if call.argument is None:
            raise PinAndCiteError(f"{template}:{call.line}: {call.function}() takes a literal string")
        if call.highlight is False:
            raise PinAndCiteError(
                f"{template}:{call.line}: {call.function}() takes {HIGHLIGHT}= as a "
                f"literal string (bump carries it with the citation)"
            )
        found.append(Written(call.function, call.argument, template, call.line, call.highlight, tuple(call.more)))
    return found


class _Call(NamedTuple):
    """A call of a name in a template, as JSON can keep it: its first argument and highlight= keyword when
    they are literal strings (None for a missing or non-literal argument, False for a non-literal highlight)."""

    function: str
    line: int
    argument: str | None
    highlight: str | None | bool
    more: list[str]


def _every_call(text: str, template: Path) -> list[_Call]:
    try:
        tree = sandbox.environment().parse(text, name=template.name, filename=str(template))
    except jinja2.TemplateSyntaxError as exc:
        raise PinAndCiteError(f"{template}:{exc.lineno}: template syntax error: {exc.message}") from None
    except RecursionError:  # Jinja's parser recurses once per parenthesis, filter or attribute
        raise PinAndCiteError(f"{template}:?: the template nests too deep for Jinja to parse") from None
    found = []
    for call in tree.find_all(nodes.Call):
        if isinstance(call.node, nodes.Name):
            arg = call.args[0] if call.args else None
            literal = isinstance(arg, nodes.Const) and isinstance(arg.value, str)
            highlight = next((kw.value for kw in call.kwargs if kw.key == HIGHLIGHT), None)
            if highlight is not None:
                highlight = (
                    highlight.value
                    if isinstance(highlight, nodes.Const) and isinstance(highlight.value, str)
                    else False
                )
            more = [a.value for a in call.args[1:] if isinstance(a, nodes.Const) and isinstance(a.value, str)]
            found.append(_Call(call.node.name, call.lineno, arg.value if literal else None, highlight, more))
    return found


class TemplateMissing(PinAndCiteError):
    """No file is there (a template includes one that does not exist)."""


def template_text(template: Path, notes_dir: Path | None = None) -> str:
    """The template's text, read through one descriptor checked once: a regular file reached from `notes_dir`
    (else from its own folder) through no symlink (pin_and_cite.core.regular_file.read_beneath), as UTF-8
    whatever the locale; bytes that are not UTF-8 are one line naming the line that holds them."""
    beneath = notes_dir is not None and template.is_relative_to(notes_dir)  # a scratch note may sit elsewhere
    data = read_beneath(notes_dir if beneath else template.parent, template, MAX_NOTES_FILE)
    if data is None:
        raise TemplateMissing(f"{template} does not exist")
    if len(data) > MAX_NOTES_FILE:
        raise PinAndCiteError(f"{template} is larger than {MAX_NOTES_FILE >> 20} MiB; no file of ours is")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise PinAndCiteError(f"{template}:{line}: the template is not UTF-8 text ({exc.reason})") from None


class NotesLoader(jinja2.BaseLoader):
    """The templates under `notes_dir`, for Jinja, each read by template_text (Jinja's FileSystemLoader follows
    symlinks). One loader serves one run, so a template read once stays up to date for it."""

    def __init__(self, notes_dir: Path):
        self.notes_dir = notes_dir

    def get_source(self, environment, name):
        path = self.notes_dir.joinpath(*jinja2.loaders.split_template_path(name))
        try:
            text = template_text(path, self.notes_dir)
        except TemplateMissing:
            raise jinja2.TemplateNotFound(name) from None
        return text, str(path), lambda: True

    def list_templates(self):
        return [t.relative_to(self.notes_dir).as_posix() for t in template_files(self.notes_dir)]


def template_files(notes_dir: Path) -> list[Path]:
    """Every template, partials included; at most MAX_TEMPLATES, so that one run's work has a bound (the
    study has 60)."""
    found = sorted(notes_dir.glob(TEMPLATE_GLOB))
    if len(found) > MAX_TEMPLATES:
        raise PinAndCiteError(f"{notes_dir} holds {len(found)} templates, over the bound of {MAX_TEMPLATES}")
    return found


def note_templates(notes_dir: Path) -> list[Path]:
    """Every template that becomes a page of its own (partials, named `_*.md.j2`, are rendered by others)."""
    return [t for t in template_files(notes_dir) if not t.name.startswith("_")]


def written_calls(context: Context, functions: set[str]) -> list[Written]:
    templates = template_files(context.notes_dir)
    return [w for template in templates for w in calls_in(template, functions, context)]


def rewrite_arguments(template: Path, changes: list[tuple[Written, str] | tuple[Written, str, str]]) -> bytes:
    """The template's bytes with the string literal of each written call replaced by a new argument (and,
    given a third item, the literal of its highlight= keyword by a new highlight), and every other byte
    (quotes, spacing, line endings, the rest of the note) exactly as it was."""
    text = template.read_bytes().decode("utf-8")
    line_starts = [0] + [m.end() for m in re.finditer(r"\r\n|\r|\n", text)]  # as Jinja counts lines
    edits: dict[int, tuple[int, str]] = {}
    for call, argument, *highlight in sorted(changes, key=lambda change: change[0].line):
        keyword = (
            r"""\s*,\s*""" + HIGHLIGHT + r"""\s*=\s*(['"])""" + re.escape(call.highlight) + r"\3"
            if call.highlight is not None
            else r"(?!\s*,\s*" + HIGHLIGHT + r"\s*=)"
        )  # the call's only keyword
        literal = re.compile(r"""((['"])""" + re.escape(call.argument) + r"\2)" + keyword)
        match = literal.search(text, line_starts[call.line - 1])
        while match and match.start() in edits:  # the same citation twice: take the next one
            match = literal.search(text, match.start() + 1)
        if match is None:
            raise PinAndCiteError(f"{template}:{call.line}: cannot find the literal {call.argument!r} to rewrite")
        edits[match.start(1)] = (match.end(1), match[2] + argument + match[2])
        if highlight:
            edits[match.start(3)] = (match.end(), match[3] + highlight[0] + match[3])
    for start in sorted(edits, reverse=True):
        end, replacement = edits[start]
        text = text[:start] + replacement + text[end:]
    return text.encode("utf-8")

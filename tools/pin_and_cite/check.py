"""`check`: prove, offline, that every citation (in the notes, and in the reference's docstrings, where no
hand-typed upstream line number may stand: pin_and_cite.core.code_citations) and every rendered default still
says what the lock says it says, and that every note keeps the rules of the project's plugin
(pin_and_cite.site.plugin), names tests that exist, and renders (the plugin's helpers included); and that each
recorded bump's excerpts still hash as its record says (pin_and_cite.site.changes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pin_and_cite.core.citation import parse_spec
from pin_and_cite.core.code_citations import code_citations, code_texts, hand_typed_lines
from pin_and_cite.core.context import Context
from pin_and_cite.core.defaults import default_ref, parse_key
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.highlights import checked_highlight
from pin_and_cite.core.locked import locked_default, locked_excerpt
from pin_and_cite.core.notes import template_files, written_calls
from pin_and_cite.core.pinned_sha import stale_sha
from pin_and_cite.core.project import Project
from pin_and_cite.core.release import stale_distributions
from pin_and_cite.core.resolve import Resolver
from pin_and_cite.core.sandbox import RunOverBudget
from pin_and_cite.core.verified_by import missing_test
from pin_and_cite.site.changes import record_problems
from pin_and_cite.site.render import Renderer, pages


@dataclass
class Problem:
    where: str  # "reading_notes/x.md.j2:12" or "citations.lock"
    cite: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.cite}: {self.message}"


@dataclass
class Report:
    checked: int  # citations, defaults and named tests
    ok: int  # those of them that hold
    problems: list[Problem]  # theirs, and the notes' rules, renders, bump records and pinned-SHA files

    def as_json(self) -> dict:
        return {"checked": self.checked, "broken": len(self.problems), "problems": [vars(p) for p in self.problems]}


def _verdict(prove, *args) -> str | None:
    """Why `prove(*args)` fails, or None when it holds."""
    try:
        prove(*args)
    except PinAndCiteError as exc:
        return str(exc)
    return None


def verify_locked(project: Project, resolver: Resolver, key: str) -> str | None:
    """Why the locked citation `key` no longer holds, or None when it does."""
    return _verdict(locked_excerpt, project, resolver, key)


def written_key(call) -> str:
    """The lock key of a cite()/upstream()/default() call written in a template."""
    if call.function != "default":
        return str(parse_spec(call.argument))
    if len(call.more) != 1:
        raise PinAndCiteError("default() takes two literal strings: SOURCE:PATH::Qual.name and the parameter name")
    return str(default_ref(call.argument, call.more[0]))


def check(project: Project) -> Report:
    """Verify every locked citation, every citation and highlight written in the notes (placed at its
    file:line), and that every test a note names with verified_by() exists: every problem, in one run."""
    resolver = Resolver(project, allow_remote=False)
    context = Context(project.root, resolver.parsed)
    verdicts = {key: verify_locked(project, resolver, key) for key in project.lock.citations}
    verdicts |= {
        key: _verdict(lambda k: locked_default(project, resolver, parse_key(k)), key) for key in project.lock.defaults
    }
    problems, in_notes, malformed, broken = [], set(), 0, {key for key, why in verdicts.items() if why}
    bad_highlights = set()  # (key, highlight) of each one reported
    written = written_calls(context, {"cite", "upstream", "verified_by", "default"})
    code = code_texts(project.root)
    written += code_citations(code)  # the reference's docstrings cite upstream too
    claims = [call for call in written if call.function == "verified_by"]
    for call in (call for call in written if call.function != "verified_by"):
        where = call.where(project.root)
        try:
            key = written_key(call)
        except PinAndCiteError as exc:
            problems.append(Problem(where, call.argument, str(exc)))
            malformed += 1
            continue
        in_notes.add(key)
        how = f"cite --default {call.more[0]} {call.argument}" if call.function == "default" else "cite"
        if key in verdicts:
            why = verdicts[key]
        elif left := project.lock.left_by_bump(key):
            why = left
        else:
            why = f"not in the lock; run `tools/pin-and-cite {how}` on it"
        if why:
            problems.append(Problem(where, key, why))
            broken.add(key)
        elif call.highlight and (why := _verdict(_check_highlight, project, resolver, key, call.highlight)):
            problems.append(Problem(where, "render", why))
            bad_highlights.add((key, call.highlight))
    problems += [Problem("citations.lock", key, why) for key, why in verdicts.items() if why and key not in in_notes]
    missing = [
        Problem(c.where(project.root), c.argument, why) for c in claims if (why := missing_test(context, c.argument))
    ]
    problems += missing
    problems += [
        Problem(
            where,
            what,
            "a hand-typed upstream line number, which nothing keeps true; cite the code "
            "as SOURCE:PATH::Qual.name instead",
        )
        for where, what in hand_typed_lines(code, project.root)
    ]
    problems += _render_problems(project, resolver, problems, broken | bad_highlights)
    problems += [Problem("citations.lock", what, why) for what, why in record_problems(project, resolver)]
    problems += [Problem(f"reading_notes/{sha_file}", "pins.toml", why) for sha_file, why in stale_sha(project)]
    problems += [Problem(*found) for found in stale_distributions(project)]
    checked = len(verdicts.keys() | in_notes) + malformed + len(claims)
    return Report(checked, checked - len(broken) - malformed - len(missing), problems)


def _check_highlight(project: Project, resolver: Resolver, key: str, highlight: str) -> None:
    """Refuse a highlight as render would: checked here for every call, since a render stops at its first. The
    verdict is a fact of the pinned file, kept in the parse cache: reading the file's statements back is what
    checking it costs."""
    excerpt = locked_excerpt(project, resolver, key)
    spec = str(excerpt.spec)

    def problem() -> str | None:
        return _verdict(checked_highlight, spec, highlight, excerpt.lines, resolver.statements_in(excerpt))

    what = f"highlight {highlight} of {spec} L{excerpt.lines[0]}-L{excerpt.lines[1]}"
    if why := resolver.parsed.get(excerpt.blob, what, problem, _text_or_none):
        raise PinAndCiteError(why)


def _text_or_none(value) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError("a highlight's verdict is a message or null")
    return value


def _past_reported(show, function: str, reported: set) -> Callable[..., str]:
    """The renderer's global `show` (cite, upstream or default), rendering nothing for a citation, default or
    highlight already reported, so that the render goes on to the rest of the page."""

    def shown(argument: str, *more: str, highlight: str | None = None) -> str:
        key = str(default_ref(argument, *more)) if function == "default" else str(parse_spec(argument))
        if key in reported or (key, highlight) in reported:
            return ""
        return show(argument, *more, highlight=highlight) if highlight else show(argument, *more)

    return shown


def _render_problems(project: Project, resolver: Resolver, found: list[Problem], skipped: set) -> list[Problem]:
    """The note rules of every template, then, in memory, the render of every page, whatever else was found
    (so one run reports everything), rendering nothing for the `skipped` citations and highlights: its first
    error (traces, diagrams, Jinja) unless that line already has a problem reported."""
    renderer, problems = Renderer(project, resolver), []
    if skipped:  # pages rendered past reported problems are not the pages a render makes: none is kept
        renderer.pages = None
    for name in ("cite", "upstream", "default"):
        renderer.env.globals[name] = _past_reported(renderer.env.globals[name], name, skipped)
    for template in template_files(project.notes_dir):
        problems += [
            Problem(f"{template.relative_to(project.root)}:{p.line}", "note rules", p.message)
            for p in renderer.rule_problems(template)
        ]
    reported = {p.where for p in found + problems}
    for template, context, page in pages(project):
        renderer.page = page  # as render names it, so that both keep the same pages
        try:
            renderer.render(template, rules=False, **context)
        except RunOverBudget:
            raise
        except PinAndCiteError as exc:
            where_line, _, message = str(exc).partition(": ")
            if where_line not in reported:  # one problem per line, not one per source page
                problems.append(Problem(where_line, "render", message))
                reported.add(where_line)
    return problems

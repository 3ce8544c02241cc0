"""The rules a note keeps, checked on the template itself so each problem has a file:line.

Every template declares its rules in YAML front matter (mkdocs reads it as page metadata), one of RULES:
a note that drops the line must not slip out of its rules unseen, so `rules: none` is written, not implied.
`rules: close-reading` (the lab brief's rules for a close reading):
  * at least MIN_CHOICES design choices: `### ` sections, each citing upstream lines with cite(), CHOICE_WORDS
    words of prose long, naming at least one test with verified_by(), and upstream evidence: a test that runs
    upstream itself (marked `@pytest.mark.upstream`, pin_and_cite.core.verified_by), or
    reference_only(REASON, "detail") with REASON from a fixed list and a reference test beside it;
  * a closing `## Connect the dots` section that prints at least one rendered value (`{{ ... }}`, numbers
    from a recorded trace, never typed by hand);
  * at most MAX_WORDS words in all, headings included: every word of prose a reader reads.
`rules: questions` (the "Check yourself" page): every `### ` section is a question whose answer has at most
ANSWER_WORDS words of prose, cites upstream (cite() or upstream()) and names a test (verified_by()); a
reference_only() there too gives a reason from the fixed list.
`rules: walkthrough` (a page that teaches a topic before its close reading): a notation box (an admonition
titled "Notation"), at least one Run it block showing its recorded output (study.run_it; the
recording holds the block's commands as written), a `## Predict, then run` section of at least MIN_EXERCISES
`### ` exercises each with a collapsed answer (`<details>`), and links to a close reading, a reference module
page and the Check-yourself questions.
Prose is what a reader reads as text: front matter, fenced blocks and Jinja statements and comments are not
counted, the outputs of NOT_PROSE_CALLS are not counted (excerpts, diagrams, charts, evidence lines), and any
other `{{ expression }}` counts as one word (a number, a rendered default). So does an upstream() link, though
it renders as path, lines, symbol and commit: it is a reference, read as a footnote marker is, not prose (a
note whose every claim links its lines would otherwise spend a third of its words on file names).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from pathlib import Path

from pin_and_cite.core.bounded import read_file
from pin_and_cite.core.context import Context
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.notes import calls_in, note_templates, template_text
from pin_and_cite.core.project import NOTES_DIR
from pin_and_cite.core.verified_by import evidence_of, reference_only_problem
from pin_and_cite.site.plugin import RuleProblem
from study.run_it import RunIt, read_recording, run_it_blocks

MAX_WORDS = 300
MIN_CHOICES = 5
CHOICE_WORDS = (50, 80)
ANSWER_WORDS = 80
CONNECT_HEADING = "## connect the dots"
NOT_PROSE_CALLS = ("cite", "diagram", "chart", "verified_by", "reference_only")
CITING_CALLS = {"cite", "upstream"}
EVIDENCE_CALLS = {"verified_by", "reference_only"}
_JINJA_BLOCKS = {"{#": "#}", "{%": "%}"}  # a comment or statement, to the first closer after it
_EXPRESSIONS = {"{{": "}}"}
_ALNUM = re.compile(r"[A-Za-z0-9]")
RULES = ("close-reading", "questions", "walkthrough", "none")
MIN_EXERCISES = 3
MAX_NOTE_BYTES = 1 << 20
EXERCISES_HEADING = "## predict, then run"
_NOTATION_BOX = re.compile(r'(?:!!!|\?\?\?\+?)\s+[\w-]+\s+"Notation"')
_TARGET = re.compile(r"[^)#\s]+")  # a link target, from its `](` to its `)`, `#` or a space
VALUE = "{{value}}"  # what a printed expression becomes: one word, and never text a template can hold


def _blank_keeping_lines(span: str, inner: str) -> str:
    return "\n" * span.count("\n")


def _expression(span: str, inner: str) -> str:
    shown = "" if inner.strip().startswith(NOT_PROSE_CALLS) else f" {VALUE} "
    return shown + "\n" * span.count("\n")


def replace_spans(text: str, pairs: dict[str, str], replace, gap: int = 0) -> str:
    """`text` with each span from an opener (a key of `pairs`, all starting with the same character) to the
    first closer `gap` or more characters after it (none inside the gap) replaced by `replace(span, inner)`,
    left to right: what `re.sub(r"OPEN.{gap,}?CLOSE", ...)` does, in one pass. The regex rescans to the end
    of the text at every opener no closer follows, so a note of 100,000 `{%` took minutes."""
    lead, out, done, pos = next(iter(pairs))[0], [], 0, 0
    next_closer: dict[str, int] = {}  # closer -> the first at or after the last search for it (-1: none)
    while (start := text.find(lead, pos)) >= 0:
        pos = start + 1
        opener = next((o for o in pairs if text.startswith(o, start)), None)
        if opener is None:
            continue
        closer, inside = pairs[opener], start + len(opener)
        if gap and text.find(closer, inside, inside + gap) >= 0:
            continue
        found = next_closer.get(closer)
        if found is None or 0 <= found < inside + gap:  # openers come in order: a search is reused until passed
            found = next_closer[closer] = text.find(closer, inside + gap)
        if found < 0:
            if all(next_closer.get(c) == -1 for c in pairs.values()):
                break  # no closer follows: nothing more to replace
            continue
        out += [text[done:start], replace(text[start : found + len(closer)], text[inside:found])]
        done = pos = found + len(closer)
    return "".join(out) + text[done:]


def front_matter(text: str) -> tuple[dict[str, str], int]:
    """Simple `key: value` front matter and the number of lines it takes (0 when absent)."""
    lines = text.split("\n")
    if not lines or lines[0].strip() != "---":
        return {}, 0
    for end in range(1, len(lines)):
        if lines[end].strip() == "---":
            pairs = (line.split(":", 1) for line in lines[1:end] if ":" in line)
            return {k.strip(): v.strip() for k, v in pairs}, end + 1
    return {}, 0


def prose_lines(text: str) -> list[tuple[int, str, bool]]:
    """(line number, prose text, is_heading) for each template line, Jinja outside prose removed."""
    stripped = replace_spans(replace_spans(text, _JINJA_BLOCKS, _blank_keeping_lines), _EXPRESSIONS, _expression)
    _, skip = front_matter(text)
    out, fence = [], None
    for number, line in enumerate(stripped.split("\n"), start=1):
        if number <= skip:
            continue
        marker = re.match(r"\s*(`{3,}|~{3,})", line)
        if marker:
            fence = None if fence and marker.group(1).startswith(fence) else fence or marker.group(1)
            continue
        if fence:
            continue
        tags_out = replace_spans(line, {"<": ">"}, lambda span, inner: " ", gap=1)  # HTML tags, then link targets
        line = replace_spans(tags_out, {"](": ")"}, lambda span, inner: "]")
        out.append((number, line, line.lstrip().startswith("#")))
    return out


def words(line: str) -> int:
    """The words of a line: runs of non-space holding a letter or digit."""
    return sum(1 for token in line.split() if _ALNUM.search(token))


@dataclass(frozen=True)
class _Section:
    """A `##`/`###` heading and the template lines up to the next one: the words of prose and the calls they
    hold."""

    line: int
    title: str
    end: int
    words: int = 0
    calls: tuple = ()

    def holds(self, line: int) -> bool:
        return self.line < line < self.end

    @property
    def name(self) -> str:
        return self.title.lstrip("#").strip()


def _sections(lines: list[tuple[int, str, bool]], last_line: int, calls=()) -> list[_Section]:
    """The sections, each with its prose words and `calls`, in one pass over the lines: a note of 30,000
    questions took minutes when each question counted the whole note."""
    headings = [(n, line.strip()) for n, line, heading in lines if heading and line.lstrip().startswith("##")]
    starts, ends = [n for n, _ in headings], [n for n, _ in headings[1:]] + [last_line + 1]
    held_words, held_calls = [0] * len(headings), [[] for _ in headings]

    def holding(line: int) -> int | None:
        k = bisect.bisect_left(starts, line) - 1  # the last heading above the line
        return k if k >= 0 and line < ends[k] else None

    for n, line, heading in lines:
        if not heading and (k := holding(n)) is not None:
            held_words[k] += words(line)
    for call in calls:
        if (k := holding(call.line)) is not None:
            held_calls[k].append(call)
    return [
        _Section(n, title, end, held_words[k], tuple(held_calls[k]))
        for k, ((n, title), end) in enumerate(zip(headings, ends))
    ]


def _kinds_of_tests(context: Context, section: _Section) -> set[str | None]:
    """The kind of evidence ("upstream", "reference"; None for a test that does not exist, which check reports
    on its own) of each test the section names with verified_by()."""
    named = [c.argument for c in section.calls if c.function == "verified_by"]
    return {getattr(evidence_of(context, test), "kind", None) for test in named}


def _reason_problems(calls) -> list[RuleProblem]:
    return [
        RuleProblem(c.line, problem)
        for c in calls
        if c.function == "reference_only" and (problem := reference_only_problem(c.argument))
    ]


def check_note(template: Path, context: Context) -> list[RuleProblem]:
    """Every rule the template's front matter declares, broken (`context`: the checkout, whose tests the
    evidence names): this study's `note_rules` (study.plugin)."""
    text = template_text(template, context.notes_dir)
    declared = front_matter(text)[0].get("rules")
    if declared not in RULES:
        what = "no 'rules:' front matter" if declared is None else f"'rules: {declared}' is not a kind of page"
        return [RuleProblem(1, f"{what}: open the page with '---', 'rules: KIND', '---'; KIND is {' or '.join(RULES)}")]
    rules = {"close-reading": _close_reading, "questions": _questions, "none": None}.get(declared)
    if declared == "walkthrough":
        return _walkthrough(template, context.root, text)
    if rules is None:
        return []
    lines = prose_lines(text)
    calls = calls_in(template, CITING_CALLS | EVIDENCE_CALLS, context)
    last_line = len(text.split("\n"))
    problems = rules(context, lines, _sections(lines, last_line, calls), last_line) + _reason_problems(calls)
    return sorted(problems, key=lambda p: p.line)


def _questions(_context: Context, lines, sections: list[_Section], last_line: int) -> list[RuleProblem]:
    problems = []
    questions = [s for s in sections if s.title.startswith("### ")]
    for q in questions:
        if q.words > ANSWER_WORDS:
            problems.append(
                RuleProblem(q.line, f"the answer to {q.name!r} has {q.words} words of prose; keep it to {ANSWER_WORDS}")
            )
        found = {c.function for c in q.calls}
        if not found & CITING_CALLS:
            problems.append(RuleProblem(q.line, f"the answer to {q.name!r} cites no upstream lines; add cite(...)"))
        if "verified_by" not in found:
            problems.append(
                RuleProblem(q.line, f"the answer to {q.name!r} names no test: add verified_by('tests/...::test_...')")
            )
    if not questions:
        problems.append(RuleProblem(1, "no questions: each '### ' heading is a question, answered below it"))
    return problems


def _close_reading(context: Context, lines, sections: list[_Section], last_line: int) -> list[RuleProblem]:
    problems, total, over_at = [], 0, None
    for number, line, _ in lines:
        before, total = total, total + words(line)
        if before <= MAX_WORDS < total and over_at is None:
            over_at = number
    if over_at is not None:
        problems.append(
            RuleProblem(
                over_at,
                f"{total} words, over the {MAX_WORDS}-word limit (word {MAX_WORDS + 1} "
                f"is on this line); headings count, excerpts and diagrams do not",
            )
        )
    expressions = {number for number, line, _ in lines if VALUE in line}
    connect = [s for s in sections if s.title.lower() == CONNECT_HEADING]
    if not connect:
        problems.append(
            RuleProblem(
                last_line,
                f"no '{CONNECT_HEADING[3:].capitalize()}' section: end the note with "
                f"'## Connect the dots' tied to measured numbers",
            )
        )
    elif sections[-1] != connect[0]:
        problems.append(RuleProblem(sections[-1].line, "the note must end with its 'Connect the dots' section"))
    elif not any(connect[0].holds(n) for n in expressions):
        problems.append(
            RuleProblem(
                connect[0].line,
                "'Connect the dots' prints no measured number: render it from a trace with {{ ... }}, never type it",
            )
        )
    choices = 0
    for s in (s for s in sections if s.title.startswith("### ")):
        if not any(c.function == "cite" for c in s.calls):
            problems.append(RuleProblem(s.line, f"design choice {s.name!r} cites no upstream lines; add cite(...)"))
            continue
        choices += 1
        count = s.words
        if not CHOICE_WORDS[0] <= count <= CHOICE_WORDS[1]:
            problems.append(
                RuleProblem(
                    s.line,
                    f"design choice {s.name!r} has {count} words of prose; write {CHOICE_WORDS[0]}-{CHOICE_WORDS[1]}",
                )
            )
        problems += _evidence_problems(s, _kinds_of_tests(context, s))
    if choices < MIN_CHOICES:
        problems.append(
            RuleProblem(
                1,
                f"{choices} cited design choice(s) ('### ' sections with cite()); "
                f"a close reading needs at least {MIN_CHOICES}",
            )
        )
    return problems


def _evidence_problems(choice: _Section, kinds: set[str | None]) -> list[RuleProblem]:
    """A design choice names a test, and upstream evidence: an upstream test, or reference_only() beside a
    reference test (the reason says why upstream cannot run; the reference test still shows the claim)."""
    if not kinds:
        return [RuleProblem(choice.line, f"design choice {choice.name!r} names no test: add verified_by(...)")]
    if "upstream" in kinds:
        return []
    if not any(c.function == "reference_only" for c in choice.calls):
        return [
            RuleProblem(
                choice.line,
                f"design choice {choice.name!r} has no upstream evidence: name a test "
                f"marked @pytest.mark.upstream(SOURCE) with verified_by(...), or say "
                f"why upstream cannot run here with reference_only(...)",
            )
        ]
    if "reference" not in kinds:
        return [
            RuleProblem(
                choice.line,
                f"design choice {choice.name!r} is reference only but names no reference test: "
                f"add verified_by(...) for the test of reference/ that shows it",
            )
        ]
    return []


def _link_targets(text: str) -> list[str]:
    """The `.md` files the text links to (`](page.md)`, `](page.md#part)`), in one pass: a regex that
    backtracks from every `](` to the end of the text took minutes on a note of 100,000 of them."""
    found, pos, closing = [], 0, -1
    while (start := text.find("](", pos)) >= 0:
        target = _TARGET.match(text, start + 2)
        if target is None:
            pos = start + 2
            continue
        end, pos = target.end(), target.end()  # a `](` inside the target ends where it ends: none can be a link
        if len(target.group()) < 4 or not target.group().endswith(".md") or end == len(text) or text[end] not in ")#":
            continue
        if text[end] == "#":
            if closing < end:
                closing = text.find(")", end)
            if closing < 0:
                break
            end = closing
        found.append(target.group())
        pos = end + 1
    return found


def _linked_kinds(template: Path, root: Path, text: str) -> set[str]:
    """What the page links to: "close-reading" and "questions" (by the linked note's rules), "reference"
    (a page under reference/)."""
    kinds, notes = set(), (root / NOTES_DIR).resolve()
    for target in _link_targets(text):
        linked = (template.parent / f"{target}.j2").resolve()
        page = read_file(linked, MAX_NOTE_BYTES, target) if linked.is_relative_to(notes) else None
        if page is None:
            continue
        if linked.parent == notes / "reference":
            kinds.add("reference")
        kinds.add(front_matter(page.decode("utf-8", errors="replace"))[0].get("rules", ""))
    return kinds


def _walkthrough(template: Path, root: Path, text: str) -> list[RuleProblem]:
    lines = text.split("\n")
    problems = []
    if not any(_NOTATION_BOX.match(line.strip()) for line in lines):
        problems.append(
            RuleProblem(1, "no notation box: add '!!! note \"Notation\"' defining every symbol the page uses")
        )
    blocks = run_it_blocks(text)
    if not blocks:
        problems.append(RuleProblem(1, "no Run it block: add a fenced block with 'run-it' in its info string"))
    for block in blocks:
        problems += _run_it_problems(root, block)
    prose = prose_lines(text)
    sections = _sections(prose, len(lines))
    exercises = [s for s in sections if s.title.lower() == EXERCISES_HEADING]
    if not exercises:
        problems.append(RuleProblem(1, f"no '## Predict, then run' section of {MIN_EXERCISES} exercises or more"))
    else:
        start = exercises[0].line
        end = min([s.line for s in sections if s.title.startswith("## ") and s.line > start], default=len(lines) + 1)
        own = [s for s in sections if start < s.line < end and s.title.startswith("### ")]
        for exercise in own:
            if not any("<details" in line for line in lines[exercise.line : exercise.end - 1]):
                problems.append(
                    RuleProblem(exercise.line, f"exercise {exercise.name!r} has no collapsed answer: add <details>")
                )
        if len(own) < MIN_EXERCISES:
            problems.append(
                RuleProblem(
                    exercises[0].line, f"{len(own)} exercise(s) ('### ' sections); write {MIN_EXERCISES} or more"
                )
            )
    linked = _linked_kinds(template, root, text)
    for kind, what in (
        ("close-reading", "close reading"),
        ("reference", "reference module page"),
        ("questions", "Check-yourself page"),
    ):
        if kind not in linked:
            problems.append(RuleProblem(1, f"links to no {what} of the topic: link it with [title](page.md)"))
    return sorted(problems, key=lambda p: p.line)


def _run_it_problems(root: Path, block: RunIt) -> list[RuleProblem]:
    """A Run it block has commands, shows its recorded output, and the recording is of these commands."""
    if not block.commands:
        return [RuleProblem(block.line, "the Run it block holds no command")]
    if block.recording is None:
        return [RuleProblem(block.line, "the Run it block shows no output: follow it with {{ run_output('NAME') }}")]
    try:
        recorded, _ = read_recording(root / NOTES_DIR, block.recording)
    except PinAndCiteError as exc:
        return [RuleProblem(block.line, str(exc))]
    if recorded != block.commands:
        return [
            RuleProblem(
                block.line,
                f"runs/{block.recording}.txt recorded other commands than the block's: re-record it "
                f"with tools/record-runs",
            )
        ]
    return []


def walkthrough_runs(notes_dir: Path) -> list[tuple[Path, RunIt]]:
    """Every Run it block of every walkthrough (`rules: walkthrough`), with its template: what tools/record-runs
    records and tests/evidence/test_run_it.py runs again."""
    return [
        (template, block)
        for template in note_templates(notes_dir)
        if front_matter(text := template_text(template))[0].get("rules") == "walkthrough"
        for block in run_it_blocks(text)
    ]

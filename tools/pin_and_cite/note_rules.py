"""The rules a close-reading note keeps, checked on the template itself so each problem has a file:line.

A template opts in with YAML front matter `rules: close-reading` (mkdocs reads the same front matter as page
metadata). Such a note:
  * has at least MIN_CHOICES design choices: `### ` sections, each citing upstream lines with cite() and
    CHOICE_WORDS words of prose long;
  * ends with a `## Connect the dots` section that prints at least one rendered value (`{{ ... }}`, numbers
    from a recorded trace, never typed by hand);
  * has at most MAX_WORDS words of prose in all.
Prose is what a reader reads as text: headings, front matter, fenced blocks and Jinja statements and comments
are not counted, cite()/diagram()/verified_by() outputs are not counted (excerpts and diagrams), and any other
`{{ expression }}` counts as one word (a number).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pin_and_cite.notes import calls_in

MAX_WORDS = 300
MIN_CHOICES = 5
CHOICE_WORDS = (50, 80)
CONNECT_HEADING = "## connect the dots"
NOT_PROSE_CALLS = ("cite", "diagram", "verified_by")
_JINJA_BLOCK = re.compile(r"\{#.*?#\}|\{%.*?%\}", re.S)
_EXPRESSION = re.compile(r"\{\{(.*?)\}\}", re.S)
_WORD = re.compile(r"\S*[A-Za-z0-9]\S*")
VALUE = "{{value}}"     # what a printed expression becomes: one word, and never text a template can hold


@dataclass(frozen=True)
class RuleProblem:
    line: int
    message: str


def _blank_keeping_lines(match: re.Match) -> str:
    return "\n" * match.group(0).count("\n")


def _expression(match: re.Match) -> str:
    inner = match.group(1).strip()
    shown = "" if inner.startswith(NOT_PROSE_CALLS) else f" {VALUE} "
    return shown + "\n" * match.group(0).count("\n")


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
    stripped = _EXPRESSION.sub(_expression, _JINJA_BLOCK.sub(_blank_keeping_lines, text))
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
        line = re.sub(r"\]\([^)]*\)", "]", re.sub(r"<[^>]+>", " ", line))   # link targets, HTML tags
        out.append((number, line, line.lstrip().startswith("#")))
    return out


def words(line: str) -> int:
    return len(_WORD.findall(line))


def check_note(template: Path) -> list[RuleProblem]:
    text = template.read_text()
    meta, _ = front_matter(text)
    if meta.get("rules") != "close-reading":
        return []
    lines = prose_lines(text)
    cites = [call.line for call in calls_in(template, {"cite"})]
    expressions = {number for number, line, _ in lines if VALUE in line}
    headings = [(n, line.strip()) for n, line, heading in lines if heading and line.lstrip().startswith("##")]
    last_line = len(text.split("\n"))
    problems, total, over_at = [], 0, None
    for number, line, heading in lines:
        if not heading:
            before, total = total, total + words(line)
            if before <= MAX_WORDS < total and over_at is None:
                over_at = number
    if over_at is not None:
        problems.append(RuleProblem(over_at, f"{total} words of prose, over the {MAX_WORDS}-word limit "
                                             f"(word {MAX_WORDS + 1} is on this line); excerpts and diagrams do not count"))
    connect = [n for n, title in headings if title.lower() == CONNECT_HEADING]
    if not connect:
        problems.append(RuleProblem(last_line, f"no '{CONNECT_HEADING[3:].capitalize()}' section: end the note with "
                                               f"'## Connect the dots' tied to measured numbers"))
    elif headings[-1][0] != connect[0]:
        problems.append(RuleProblem(headings[-1][0], "the note must end with its 'Connect the dots' section"))
    choices = 0
    for index, (start, title) in enumerate(headings):
        end = headings[index + 1][0] if index + 1 < len(headings) else last_line + 1
        count = sum(words(line) for n, line, heading in lines if start < n < end and not heading)
        if connect and start == connect[0] and not any(start < n < end for n in expressions):
            problems.append(RuleProblem(start, "'Connect the dots' prints no measured number: render it from a "
                                               "trace with {{ ... }}, never type it"))
        if not title.startswith("### "):
            continue
        if not any(start < n < end for n in cites):
            problems.append(RuleProblem(start, f"design choice {title[4:]!r} cites no upstream lines; add cite(...)"))
            continue
        choices += 1
        if not CHOICE_WORDS[0] <= count <= CHOICE_WORDS[1]:
            problems.append(RuleProblem(start, f"design choice {title[4:]!r} has {count} words of prose; "
                                               f"write {CHOICE_WORDS[0]}-{CHOICE_WORDS[1]}"))
    if choices < MIN_CHOICES:
        problems.append(RuleProblem(1, f"{choices} cited design choice(s) ('### ' sections with cite()); "
                                       f"a close reading needs at least {MIN_CHOICES}"))
    return sorted(problems, key=lambda p: p.line)

"""What issue #24 asks of the Check-yourself page beyond its rules (note_rules checks each answer's length,
citation and test): a section of at least five pipeline-schedule questions, each asking for a concrete
prediction (its question gives the numbers), citing megatron's pipeline code and shown by an upstream test.
Read from the template itself, so a failure names the question."""

from __future__ import annotations

import re
from pathlib import Path

from pin_and_cite.core.context import Context
from pin_and_cite.core.notes import calls_in
from pin_and_cite.core.verified_by import evidence_of

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "reading_notes" / "check-yourself.md.j2"
SECTION = "## Pipeline schedules"


def pipeline_questions() -> list[tuple[str, range]]:
    """(question, its template lines) of each `### ` question in the pipeline-schedules section."""
    lines = PAGE.read_text().split("\n")
    assert SECTION in lines, f"{PAGE.name} has no {SECTION!r} section"
    start = lines.index(SECTION) + 1
    end = next((n for n in range(start, len(lines)) if lines[n].startswith("## ")), len(lines))
    heads = [n for n in range(start, end) if lines[n].startswith("### ")] + [end]
    return [(lines[a][4:], range(a + 1, b + 1)) for a, b in zip(heads, heads[1:])]  # 1-based line numbers


def test_check_yourself_asks_five_concrete_pipeline_questions_each_cited_and_shown_upstream():
    questions = pipeline_questions()
    assert len(questions) >= 5, [q for q, _ in questions]
    calls = calls_in(PAGE, {"cite", "upstream", "verified_by"})
    for question, lines in questions:
        assert re.search(r"\b[pmv] = \d", question), f"no numbers to predict from: {question!r}"
        mine = [c for c in calls if c.line in lines]
        cited = [c.argument for c in mine if c.function in ("cite", "upstream")]
        assert any(a.startswith("megatron-lm:megatron/core/pipeline_parallel/") for a in cited), (question, cited)
        kinds = {
            getattr(evidence_of(Context(ROOT), c.argument), "kind", None) for c in mine if c.function == "verified_by"
        }
        assert "upstream" in kinds, (question, kinds)

"""Notes keep the rules they declare; `render` and `check` stop on a broken note with its file:line."""

from __future__ import annotations

import re
import shutil

import pytest

from pin_and_cite.core import sandbox
from pin_and_cite.core.context import Context
from pin_and_cite.core.errors import PinAndCiteError
from study.note_rules import check_note, prose_lines, words
from tests.tools.conftest import FREE_FORM, ROOT

CITE = "{{ cite('up:pkg/core/layers.py#L9-L10') }}"
EVIDENCE = "{{ verified_by('tests/test_claims.py::test_runs_upstream') }}"
CLAIMS = """import pytest


@pytest.mark.upstream("up")
def test_runs_upstream():
    pass


def test_runs_reference():
    pass
"""
LAYERS_LINES = "up:pkg/core/layers.py#L9-L10"
NO_CITE = "the answer to 'q' cites no upstream lines; add cite(...)"
NO_TEST = "the answer to 'q' names no test: add verified_by('tests/...::test_...')"


def note_text(
    choices: int = 5,
    words_each: int = 51,
    cite: bool = True,
    connect: str | None = "{{ 6 * 7 }} bytes.",
    extra: str = "",
    evidence: str = EVIDENCE,
) -> str:
    lines = ["---", "rules: close-reading", "---", "# A note", ""]
    for i in range(choices):
        lines += [f"### Choice {i}", "", " ".join(["word"] * words_each), "", CITE if cite else "", evidence, ""]
    lines += [extra]
    if connect is not None:
        lines += ["## Connect the dots", "", connect]
    return "\n".join(lines) + "\n"


def write_claims(root) -> None:
    """The tests a note's verified_by() names: one running upstream, one the reference."""
    (root / "tests").mkdir(exist_ok=True)
    (root / "tests" / "test_claims.py").write_text(CLAIMS)


def problems(tmp_path, text: str) -> list[tuple[int, str]]:
    write_claims(tmp_path)
    path = tmp_path / "note.md.j2"
    path.write_text(text)
    return [(p.line, p.message) for p in check_note(path, Context(tmp_path))]


def test_a_note_within_the_rules_passes(tmp_path):
    assert problems(tmp_path, note_text()) == []


def test_excerpts_diagrams_headings_and_jinja_are_not_prose(tmp_path):
    text = (
        "---\nrules: close-reading\n---\n# Title words here\n{# a comment of many words #}\n"
        "{% set x = trace('tp_block') %}\nOne two three.\n{{ cite('up:a.py#L1-L2') }} {{ diagram('tp_block') }}\n"
        "```mermaid\ngraph LR\n  a --> b\n```\n{{ verified_by('tests/x.py::test_y') }} "
        "[link text](https://example.org/a b)\n"
        '{{ x.bytes }} bytes <span class="y">shown</span>\n'
    )
    counted = [(n, words(line)) for n, line, heading in prose_lines(text) if not heading and words(line)]
    assert counted == [(7, 3), (13, 2), (14, 3)]  # "link text"; N bytes shown


def test_over_the_word_limit_names_the_line_of_word_301_counting_headings(tmp_path):
    text = note_text(choices=5, words_each=56)  # 2 (title) + 5 * (2 + 56) + 3 + 2 (Connect the dots) = 297
    assert problems(tmp_path, text) == []
    text = note_text(choices=5, words_each=57)  # 302: the headings are what a reader reads too
    line_of_word_301 = text.split("\n").index("## Connect the dots") + 3
    assert problems(tmp_path, text) == [
        (
            line_of_word_301,
            "302 words, over the 300-word limit (word 301 is on "
            "this line); headings count, excerpts and diagrams do not",
        )
    ]


def test_each_rule_is_reported_at_its_heading(tmp_path):
    found = problems(tmp_path, note_text(choices=4, cite=False, connect=None))
    assert (6, "design choice 'Choice 0' cites no upstream lines; add cite(...)") in found
    assert (1, "0 cited design choice(s) ('### ' sections with cite()); a close reading needs at least 5") in found
    assert any("no 'Connect the dots' section" in message for _, message in found)
    short = problems(tmp_path, note_text(words_each=49))
    assert (6, "design choice 'Choice 0' has 49 words of prose; write 50-80") in short
    connect_line = note_text().split("\n").index("## Connect the dots") + 1
    typed = problems(tmp_path, note_text(connect="It sent N bytes, 4096 of them."))
    assert typed == [
        (
            connect_line,
            "'Connect the dots' prints no measured number: render it from a trace with {{ ... }}, never type it",
        )
    ]
    last = problems(tmp_path, note_text(connect="{{ n }}") + "## Afterword\n\nMore.\n")
    assert last == [(connect_line + 3, "the note must end with its 'Connect the dots' section")]


def test_a_page_declares_its_rules_and_none_is_written_not_implied(tmp_path):
    """Finding 12: a close reading whose `rules:` line was dropped kept no rules at all."""
    expected = (
        "open the page with '---', 'rules: KIND', '---'; KIND is close-reading or questions or walkthrough or none"
    )
    dropped = note_text(choices=1, connect=None).replace("rules: close-reading", "title: x")
    assert problems(tmp_path, dropped) == [(1, f"no 'rules:' front matter: {expected}")]
    assert problems(tmp_path, "# A page\n\nprose\n") == [(1, f"no 'rules:' front matter: {expected}")]
    assert problems(tmp_path, "---\nrules: close reading\n---\n") == [
        (1, f"'rules: close reading' is not a kind of page: {expected}")
    ]
    assert problems(tmp_path, "---\nrules: none\n---\n# A page\n\nprose\n") == []


def test_every_design_choice_names_a_test(tmp_path):
    """Finding 12: five choices each saying reference_only("draft: ...") with no test at all passed."""
    drafts = problems(tmp_path, note_text(evidence="{{ reference_only('draft: later') }}"))
    heading_lines = [n for n, line in enumerate(note_text().split("\n"), 1) if line.startswith("### ")]
    assert [(n, m) for n, m in drafts if "names no test" in m] == [
        (line, f"design choice 'Choice {i}' names no test: add verified_by(...)")
        for i, line in enumerate(heading_lines)
    ]
    assert [n for n, m in drafts if m.startswith("reference_only('draft: later'): the reason must be one of")] == [
        line + 5 for line in heading_lines
    ]
    reason_only = problems(tmp_path, note_text(evidence="{{ reference_only('APEX', 'the fused kernel') }}"))
    assert len(reason_only) == 5 and all("names no test" in m for _, m in reason_only)


def test_reference_only_gives_a_reason_from_the_fixed_list_and_still_names_a_reference_test(tmp_path):
    reference = "{{ verified_by('tests/test_claims.py::test_runs_reference') }}"
    assert (
        problems(tmp_path, note_text(evidence="{{ reference_only('CUDA-only', 'pins host memory') }}" + reference))
        == []
    )
    assert problems(tmp_path, note_text(evidence="{{ reference_only('APEX') }}" + reference)) == []
    free_text = problems(tmp_path, note_text(evidence="{{ reference_only('the kernel needs CUDA') }}" + reference))
    assert free_text[0] == (
        11,
        "reference_only('the kernel needs CUDA'): the reason must be one of "
        "APEX, Transformer Engine, CUDA-only, NCCL-only, multi-node",
    )
    assert len(free_text) == 5
    upstream_only = problems(tmp_path, note_text(evidence="{{ reference_only('APEX') }}" + EVIDENCE))
    assert upstream_only == []  # an upstream test is the stronger evidence: the reason is then extra
    without_reference = problems(tmp_path, note_text(evidence="{{ reference_only('APEX') }}{{ verified_by('x') }}"))
    assert without_reference[0] == (
        6,
        "design choice 'Choice 0' is reference only but names no reference test: "
        "add verified_by(...) for the test of reference/ that shows it",
    )


def test_render_and_check_stop_on_a_broken_note_and_keep_the_previous_page(project):
    assert project.run("cite", LAYERS_LINES).code == 0
    write_claims(project.root)
    path = project.root / "reading_notes" / "n.md.j2"
    path.write_text(note_text())
    assert project.run("render").code == 0, project.run("render").err
    page = project.root / "docs" / "notes" / "n.md"
    before = page.read_text()
    assert "word word" in before and "rules: close-reading" in before  # mkdocs reads it as page metadata
    too_long = note_text(choices=6, words_each=60)  # word 301 is in the fifth choice, headings counted
    line = [n for n, text in enumerate(too_long.split("\n"), 1) if text == " ".join(["word"] * 60)][4]
    path.write_text(too_long)
    r = project.run("render")
    assert r.code == 2 and r.err.count("\n") == 1
    assert r.err.startswith(f"pin-and-cite: error: reading_notes/n.md.j2:{line}: 379 words, over the 300-word")
    assert page.read_text() == before
    r = project.run("check")
    assert r.code == 1 and f"reading_notes/n.md.j2:{line}: note rules: 379 words, over" in r.out


def test_a_diagram_without_a_recorded_trace_stops_render_and_check(project):
    path = project.root / "reading_notes" / "d.md.j2"
    path.write_text(FREE_FORM + "# Diagrams\n\ntext\n{{ diagram('tp_block', link='NVLink') }}\n")
    r = project.run("render")
    assert r.code == 2 and r.err.count("\n") == 1
    assert (
        "reading_notes/d.md.j2:7: no recorded trace 'tp_block' (reading_notes/traces/tp_block.json is missing" in r.err
    )
    (project.root / "reading_notes" / "traces").mkdir()
    shutil.copy(ROOT / "reading_notes" / "traces" / "tp_block.json", project.root / "reading_notes" / "traces")
    assert project.run("render").code == 0
    assert "```mermaid\nflowchart TB\n" in (project.root / "docs" / "notes" / "d.md").read_text()
    path.write_text(
        FREE_FORM + "# Diagrams\n\n{{ diagram('tp_block') }}\n"
    )  # a generator argument missing: still one line
    r = project.run("check")
    assert r.code == 1 and "reading_notes/d.md.j2:6: render: TypeError: " in r.out and "'link'" in r.out


def test_megatron_sha_is_generated_from_the_pin_and_checked(project, upstream):
    project.write_pins(**{"megatron-lm": {"url": upstream.url, "commit": upstream.v1, "sha_file": "megatron-sha.txt"}})
    sha = project.root / "reading_notes" / "megatron-sha.txt"
    r = project.run("check")
    assert r.code == 1 and "megatron-sha.txt is missing but pins.toml pins megatron-lm at" in r.out
    assert project.run("render").code == 0 and sha.read_text() == upstream.v1 + "\n"
    assert project.run("check").code == 0
    sha.write_text(upstream.v2 + "\n")
    r = project.run("check")
    assert r.code == 1 and f"says '{upstream.v2[:12]}' but pins.toml pins megatron-lm at {upstream.v1[:12]}" in r.out


def test_a_page_per_pinned_source_lists_its_locked_files_and_blobs(project, upstream):
    assert project.run("cite", LAYERS_LINES, "up:pkg/core/mappings.py::region_3").code == 0
    shutil.copy(ROOT / "reading_notes" / "_source.md.j2", project.root / "reading_notes")
    assert project.run("render").code == 0
    page = (project.root / "docs" / "notes" / "sources" / "up.md").read_text()
    lock = __import__("json").loads(project.lock_path.read_text())
    assert f"| commit | `{upstream.v1}` |" in page
    for key, entry in lock["files"].items():
        assert f"| `{key.split(':', 1)[1]}` | `{entry['blob']}` | {entry['size']} | git tree | 1 |" in page
    assert not (project.root / "docs" / "notes" / "_source.md").exists()


def test_render_and_check_refuse_a_free_text_reason_on_any_page(project):
    """reference_only() on a page with no structure rules still takes its reason from the fixed list."""
    path = project.root / "reading_notes" / "free.md.j2"
    path.write_text(FREE_FORM + "# Free\n\n{{ reference_only('draft: later') }}\n")
    expected = (
        "reference_only('draft: later'): the reason must be one of "
        "APEX, Transformer Engine, CUDA-only, NCCL-only, multi-node"
    )
    r = project.run("render")
    assert r.code == 2 and r.err == (
        f"pin-and-cite: error: reading_notes/free.md.j2:6: {expected}; "
        "that page was left as it was, the others rendered\n"
    )
    r = project.run("check")
    assert r.code == 1 and f"reading_notes/free.md.j2:6: render: {expected}\n" in r.out
    path.write_text(FREE_FORM + "# Free\n\n{{ reference_only('multi-node', 'needs <two hosts>') }}\n")
    assert project.run("render").code == 0
    assert "multi-node: needs &lt;two hosts&gt;" in (project.root / "docs" / "notes" / "free.md").read_text()


RUN_IT = "``` { .shell .run-it }\n.venv/bin/torchrun --nproc-per-node 2 -m reference --tp 2\n```\n"
SHOWN = '{{ run_output("tp-2") }}\n'
LINKS = "[close reading](tp.md), [reference](reference/layers.md), [questions](check-yourself.md)\n"


def walkthrough_text(
    notation: str = '!!! note "Notation"\n    h: hidden size\n',
    run_it: str = RUN_IT + "\n" + SHOWN,
    exercises: int = 3,
    answer: str = '<details markdown="1"><summary>Answer</summary>\n\nSix.\n\n</details>\n',
    links: str = LINKS,
) -> str:
    parts = ["---\nrules: walkthrough\n---\n# Tensor parallelism, walked through\n", notation, "## Run it\n", run_it]
    parts.append("## Predict, then run\n")
    parts += [f"### Exercise {i}\n\nChange --tp.\n\n{answer}" for i in range(exercises)]
    return "\n".join(parts + ["## Where next\n", links])


def walkthrough_problems(tmp_path, text: str, recorded: str | None = "$ " + RUN_IT.split("\n")[1] + "\nstep 0\n"):
    notes = tmp_path / "reading_notes"
    (notes / "reference").mkdir(parents=True, exist_ok=True)
    (notes / "tp.md.j2").write_text("---\nrules: close-reading\n---\n")
    (notes / "reference" / "layers.md.j2").write_text("---\nrules: none\n---\n")
    (notes / "check-yourself.md.j2").write_text("---\nrules: questions\n---\n")
    (notes / "runs").mkdir(exist_ok=True)
    (notes / "runs" / "tp-2.txt").unlink(missing_ok=True)
    if recorded is not None:
        (notes / "runs" / "tp-2.txt").write_text(recorded)
    path = notes / "walkthrough.md.j2"
    path.write_text(text)
    return [(p.line, p.message) for p in check_note(path, Context(tmp_path))]


def test_a_walkthrough_within_its_rules_passes(tmp_path):
    assert walkthrough_problems(tmp_path, walkthrough_text()) == []


def test_a_walkthrough_needs_a_notation_box_a_run_it_block_exercises_and_links(tmp_path):
    """Issue 24: a walkthrough page had no rules, so a page without notation, Run it, exercises or links passed."""
    bare = walkthrough_problems(tmp_path, walkthrough_text(notation="", run_it="", exercises=0, links=""))
    assert bare == [
        (1, "no notation box: add '!!! note \"Notation\"' defining every symbol the page uses"),
        (1, "no Run it block: add a fenced block with 'run-it' in its info string"),
        (1, "links to no close reading of the topic: link it with [title](page.md)"),
        (1, "links to no reference module page of the topic: link it with [title](page.md)"),
        (1, "links to no Check-yourself page of the topic: link it with [title](page.md)"),
        (10, "0 exercise(s) ('### ' sections); write 3 or more"),
    ]


def test_each_exercise_hides_its_answer_and_there_are_three(tmp_path):
    text = walkthrough_text(exercises=2, answer="The answer is six, in plain sight.\n")
    heading = text.split("\n").index("## Predict, then run") + 1
    first, second = (text.split("\n").index(f"### Exercise {i}") + 1 for i in (0, 1))
    found = walkthrough_problems(tmp_path, text)
    assert found == [
        (heading, "2 exercise(s) ('### ' sections); write 3 or more"),
        (first, "exercise 'Exercise 0' has no collapsed answer: add <details>"),
        (second, "exercise 'Exercise 1' has no collapsed answer: add <details>"),
    ]


def test_a_link_outside_the_notes_or_to_a_missing_page_counts_for_nothing(tmp_path):
    text = walkthrough_text(links="[a](../../outside.md), [b](gone.md), [questions](check-yourself.md)\n")
    assert [m for _, m in walkthrough_problems(tmp_path, text)] == [
        "links to no close reading of the topic: link it with [title](page.md)",
        "links to no reference module page of the topic: link it with [title](page.md)",
    ]


def test_a_run_it_block_shows_the_recording_of_its_own_commands(tmp_path):
    """Issue 24: the page's output must come from a recording of the commands as written: a block without
    run_output(), a missing recording and a recording of other commands are each caught by check, offline."""
    line = walkthrough_text().split("\n").index("``` { .shell .run-it }") + 1
    unshown = walkthrough_problems(tmp_path, walkthrough_text(run_it=RUN_IT))
    assert unshown == [(line, "the Run it block shows no output: follow it with {{ run_output('NAME') }}")]
    missing = walkthrough_problems(tmp_path, walkthrough_text(), recorded=None)
    assert missing == [(line, "no recorded run 'tp-2' (runs/tp-2.txt is missing): run tools/record-runs")]
    stale = walkthrough_problems(tmp_path, walkthrough_text(), recorded="$ .venv/bin/torchrun -m reference\nx\n")
    assert stale == [
        (line, "runs/tp-2.txt recorded other commands than the block's: re-record it with tools/record-runs")
    ]
    empty = walkthrough_problems(tmp_path, walkthrough_text(run_it="``` { .shell .run-it }\n```\n\n" + SHOWN))
    assert empty == [(line, "the Run it block holds no command")]


def bounded_problems(tmp_path, text: str) -> list[tuple[int, str]]:
    """The note's problems, found within the CPU and memory bounds the renderer gives a page's rules."""
    with sandbox.environment().bounded():
        return problems(tmp_path, text)


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param(
            "---\nrules: questions\n---\n" + "### q\n" * 30_000,
            [(n, message) for n in range(4, 30_004) for message in (NO_CITE, NO_TEST)],
            id="thirty-thousand-questions",
        ),
        pytest.param(
            '---\nrules: questions\n---\n{{ "' + "{%" * 100_000 + '" }}\n',
            [(1, "no questions: each '### ' heading is a question, answered below it")],
            id="unclosed-statements",
        ),
        pytest.param(
            "---\nrules: questions\n---\n### q\n" + "<" * 300_000 + "](" * 300_000 + "!" * 300_000 + "\n",
            [(4, NO_CITE), (4, NO_TEST)],
            id="unclosed-tags-and-links",
        ),
    ],
)
def test_the_rules_take_time_in_proportion_to_the_note(tmp_path, text, expected):
    """Each question once scanned every line of the note, and a regex rescanned to the end at every `{%`, `<`
    or `](` with no closer: minutes for a note of 30,000 questions or 100,000 `{%`. One pass over the note
    now: it ends within a page's bounds, with the same problems."""
    assert bounded_problems(tmp_path, text) == expected


def test_a_walkthrough_of_a_hundred_thousand_run_it_blocks_takes_one_pass(tmp_path):
    text = walkthrough_text() + "``` { .shell .run-it }\n```\n" * 100_000
    first = text.split("\n").index("``` { .shell .run-it }", 20) + 1
    found = [p for p in bounded_problems(tmp_path, text) if p[1] == "the Run it block holds no command"]
    assert found == [(line, "the Run it block holds no command") for line in range(first, first + 200_000, 2)]


@pytest.mark.parametrize(
    "body, message",
    [
        pytest.param(b"\xff\xfe\n", "note.md.j2:4: the template is not UTF-8 text", id="undecodable"),
        pytest.param(b"{{ " + b"(" * 3000 + b"1" + b")" * 3000 + b" }}\n", "nests too deep", id="deep-parens"),
    ],
)
def test_a_template_jinja_cannot_read_is_one_line(tmp_path, body, message):
    write_claims(tmp_path)
    path = tmp_path / "note.md.j2"
    path.write_bytes(b"---\nrules: questions\n---\n" + body)
    with pytest.raises(PinAndCiteError, match=re.escape(message)):
        check_note(path, Context(tmp_path))

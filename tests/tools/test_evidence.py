"""Each claim shows its kind of evidence: a test that runs upstream itself, a reference test, or reference only.

The kind is read from the named test's source by AST (its `@pytest.mark.upstream("SOURCE")` marker), never by
importing it; a close reading's design choice without upstream evidence, and a "Check yourself" answer without
any, fail `check` at the choice's heading.
"""

from __future__ import annotations

from pin_and_cite.core.context import Context
from pin_and_cite.core.gitobj import blob_sha
from pin_and_cite.core.parse_cache import ParseCache
from pin_and_cite.core.verified_by import Evidence, evidence_of
from study.note_rules import check_note
from tests.tools.test_note_rules import FREE_FORM, note_text

TESTS = """\
import pytest

pytestmark = [pytest.mark.slow]


@pytest.mark.upstream("up")
def test_runs_upstream():
    pass


def test_runs_reference():
    pass


@pytest.mark.parametrize("x", [1])
@pytest.mark.upstream("nowhere")
def test_marked_with_an_unpinned_source(x):
    pass


@pytest.mark.upstream("up")
class TestUpstream:
    def test_in_class(self):
        pass
"""
MODULE_MARKED = 'import pytest\n\npytestmark = pytest.mark.upstream("up")\n\n\ndef test_any():\n    pass\n'


def write_tests(root, name="test_claims.py", text=TESTS):
    (root / "tests").mkdir(exist_ok=True)
    (root / "tests" / name).write_text(text)


def test_the_marker_on_a_function_class_or_module_names_upstream_evidence(tmp_path):
    write_tests(tmp_path)
    write_tests(tmp_path, "test_module.py", MODULE_MARKED)
    assert evidence_of(Context(tmp_path), "tests/test_claims.py::test_runs_upstream") == Evidence("upstream", "up")
    assert evidence_of(Context(tmp_path), "tests/test_claims.py::test_runs_reference") == Evidence("reference")
    assert evidence_of(Context(tmp_path), "tests/test_claims.py::test_marked_with_an_unpinned_source[1]") == Evidence(
        "upstream", "nowhere"
    )
    assert evidence_of(Context(tmp_path), "tests/test_claims.py::TestUpstream::test_in_class") == Evidence(
        "upstream", "up"
    )
    assert evidence_of(Context(tmp_path), "tests/test_module.py::test_any") == Evidence("upstream", "up")


def test_a_test_that_cannot_be_read_is_one_line_never_a_traceback(tmp_path):
    write_tests(tmp_path, "test_broken.py", "def test_x(:\n")
    write_tests(tmp_path, "test_latin1.py", "")
    (tmp_path / "tests" / "test_latin1.py").write_bytes(b"# caf\xe9\ndef test_x():\n    pass\n")
    (tmp_path / "outside.py").write_text("def test_x():\n    pass\n")
    assert (
        evidence_of(Context(tmp_path), "tests/test_broken.py::test_x")
        == "tests/test_broken.py: not valid Python (line 1)"
    )
    assert evidence_of(Context(tmp_path), "tests/test_latin1.py::test_x") == "tests/test_latin1.py: not UTF-8 text"
    assert (
        evidence_of(Context(tmp_path), "tests/../outside.py::test_x") == "test file 'tests/../outside.py' does not "
        "exist under tests/"
    )
    assert evidence_of(Context(tmp_path), "tests/test_\0x.py::test_x") == (
        "test file 'tests/test_\\x00x.py' does not exist under tests/"
    )
    assert (
        evidence_of(Context(tmp_path), "tests/test_broken.py") == "'tests/test_broken.py' is not a pytest node id "
        "(tests/FILE.py::test_name)"
    )


def test_a_marker_whose_source_is_not_a_string_names_no_source_and_is_kept_in_the_parse_cache(tmp_path):
    """A contributor's `upstream(b"up")` (or 1j, ...) reads as a source of None, as a marker without one does,
    and its evidence goes through the JSON parse cache like any other (once a traceback from json.dumps)."""
    marks = "".join(f"@pytest.mark.upstream({arg})\ndef test_{i}():\n    pass\n\n\n" for i, arg in enumerate(BAD))
    write_tests(tmp_path, "test_odd.py", "import pytest\n\n\n" + marks)
    parsed = ParseCache(tmp_path / "cache")
    for i in range(len(BAD)):
        assert evidence_of(Context(tmp_path, parsed), f"tests/test_odd.py::test_{i}") == Evidence("upstream", None)
    assert (
        ParseCache(tmp_path / "cache").get(
            blob_sha((tmp_path / "tests" / "test_odd.py").read_bytes()), "tests", lambda: "recomputed", lambda v: v
        )
        != "recomputed"
    )  # the entry was written, so a later run reads it instead


BAD = ['b"up"', "1j", "...", "None", "2"]


def test_a_choice_needs_an_upstream_test_or_a_reason_upstream_cannot_run(tmp_path):
    write_tests(tmp_path)
    path = tmp_path / "note.md.j2"

    def problems(evidence: str) -> list[tuple[int, str]]:
        path.write_text(note_text(evidence=evidence))
        return [(p.line, p.message) for p in check_note(path, Context(tmp_path))]

    assert problems("{{ verified_by('tests/test_claims.py::test_runs_upstream') }}") == []
    reference = "{{ verified_by('tests/test_claims.py::test_runs_reference') }}"
    assert problems("{{ reference_only('CUDA-only', 'the fused kernel') }}" + reference) == []
    assert problems("")[0] == (6, "design choice 'Choice 0' names no test: add verified_by(...)")
    for weak in (reference, "{{ verified_by('tests/test_claims.py::test_gone') }}"):
        found = problems(weak)
        assert len(found) == 5 and found[0] == (
            6,
            "design choice 'Choice 0' has no upstream evidence: name a test "
            "marked @pytest.mark.upstream(SOURCE) with verified_by(...), or "
            "say why upstream cannot run here with reference_only(...)",
        )


QUESTIONS = """---
rules: questions
---
# Check yourself

### What does it do?

<details markdown="1"><summary>Answer</summary>
{answer}
{{{{ cite('up:pkg/core/layers.py#L9-L10') }}}}
{evidence}
</details>
"""


def test_each_question_is_answered_briefly_with_a_citation_and_evidence(tmp_path):
    write_tests(tmp_path)
    path = tmp_path / "check.md.j2"

    def problems(answer="word " * 79, evidence="{{ verified_by('tests/test_claims.py::test_runs_reference') }}"):
        path.write_text(QUESTIONS.format(answer=answer, evidence=evidence))
        return [(p.line, p.message) for p in check_note(path, Context(tmp_path))]

    assert problems() == []  # "Answer" (the summary) + 79 words
    assert problems(answer="word " * 80) == [
        (6, "the answer to 'What does it do?' has 81 words of prose; keep it to 80")
    ]
    assert problems(evidence="") == [
        (6, "the answer to 'What does it do?' names no test: add verified_by('tests/...::test_...')")
    ]
    assert problems(evidence="{{ reference_only('CUDA-only') }}") == problems(evidence="")
    path.write_text("---\nrules: questions\n---\n# Check yourself\n\nNothing yet.\n")
    assert [(p.line, p.message) for p in check_note(path, Context(tmp_path))] == [
        (1, "no questions: each '### ' heading is a question, answered below it")
    ]


def test_the_page_shows_each_kind_of_evidence_and_refuses_an_unpinned_upstream(project):
    write_tests(project.root)
    assert project.run("cite", "up:pkg/core/layers.py#L9-L10").code == 0
    note = project.root / "reading_notes" / "a.md.j2"
    note.write_text(
        FREE_FORM + "{{ verified_by('tests/test_claims.py::test_runs_upstream') }}\n"
        "{{ verified_by('tests/test_claims.py::test_runs_reference') }}\n"
        "{{ reference_only('CUDA-only', 'needs <CUDA>') }}\n"
    )
    r = project.run("render")
    assert r.code == 0, r.err
    notes = project.root / "docs" / "notes"
    page = (notes / "a.md").read_text().split("\n")
    assert page[:6] == [
        *FREE_FORM.split("\n")[:3],
        "[**upstream test (up)** `tests/test_claims.py::test_runs_upstream`](tests/test_claims.md#test_runs_upstream)"
        "{ .verified-by .evidence-upstream }",
        "[**reference test** `tests/test_claims.py::test_runs_reference`](tests/test_claims.md#test_runs_reference)"
        "{ .verified-by .evidence-reference }",
        '<span class="verified-by evidence-reference-only"><strong>reference only</strong> '
        "CUDA-only: needs &lt;CUDA&gt;</span>",
    ]
    # The test file's page shows each cited test's source (decorators included), in the file's order, numbered
    # with its lines in the test file, under a heading the link names.
    tests_page = (notes / "tests" / "test_claims.md").read_text()
    assert tests_page.startswith(
        "---\nsearch:\n  exclude: true\nhide:\n  - navigation\n  - toc\n---\n\n# `tests/test_claims.py`\n"
    )
    upstream, reference = tests_page.split("\n## ")[1:]
    assert upstream.startswith("`test_runs_upstream` { #test_runs_upstream }\n")
    assert "**upstream test: it runs the pinned upstream implementation itself (up).**" in upstream
    assert "L6–L8. Cited by: [a](../a.md)." in upstream
    assert upstream.endswith(
        '```python linenums="6"\n@pytest.mark.upstream("up")\ndef test_runs_upstream():\n    pass\n```\n'
    )
    assert reference.startswith("`test_runs_reference` { #test_runs_reference }\n")
    assert "**reference test: it runs this kit's reference implementation" in reference
    assert reference.endswith('```python linenums="11"\ndef test_runs_reference():\n    pass\n```\n')
    # A page no longer cited goes, and its folder with it.
    note.write_text(FREE_FORM + "no evidence now\n")
    assert project.run("render").code == 0
    assert not (notes / "tests").exists()
    note.write_text(FREE_FORM + "x\n{{ verified_by('tests/test_claims.py::test_marked_with_an_unpinned_source') }}\n")
    r = project.run("check")
    assert (
        r.code == 1
        and "reading_notes/a.md.j2:5: render: verified_by: tests/test_claims.py::"
        "test_marked_with_an_unpinned_source is marked upstream('nowhere'), which is not a "
        "source in pins.toml (up)"
        in r.out
    )


def test_one_section_per_test_whatever_spelling_or_parameter_cites_it(project):
    """Two spellings of one file and two parameters of one test: one page, one section each, every citer named."""
    write_tests(project.root, text=TESTS.replace("[1])", "[1, 2])").replace('"nowhere"', '"up"'))
    (project.root / "reading_notes" / "a.md.j2").write_text(
        FREE_FORM + "{{ verified_by('tests/test_claims.py::test_marked_with_an_unpinned_source[1]') }}\n"
        "{{ verified_by('tests/test_claims.py::TestUpstream::test_in_class') }}\n"
    )
    (project.root / "reading_notes" / "b.md.j2").write_text(
        FREE_FORM + "{{ verified_by('tests/./test_claims.py::test_marked_with_an_unpinned_source[2]') }}\n"
    )
    r = project.run("render")
    assert r.code == 0, r.err
    notes = project.root / "docs" / "notes"
    assert sorted(p.relative_to(notes).as_posix() for p in (notes / "tests").rglob("*.md")) == ["tests/test_claims.md"]
    page = (notes / "tests" / "test_claims.md").read_text()
    headings = [line for line in page.split("\n") if line.startswith("## ")]
    assert headings == [
        "## `test_marked_with_an_unpinned_source` { #test_marked_with_an_unpinned_source }",
        "## `TestUpstream::test_in_class` { #TestUpstream.test_in_class }",
    ]
    assert "Cited by: [a](../a.md), [b](../b.md)." in page
    assert (
        (notes / "b.md")
        .read_text()
        .startswith(
            FREE_FORM + "[**upstream test (up)** `tests/./test_claims.py::test_marked_with_an_unpinned_source[2]`]"
            "(tests/test_claims.md#test_marked_with_an_unpinned_source)"
        )
    )


def test_an_edited_test_file_is_read_again(tmp_path):
    """`mkdocs serve` renders again after an edit: the test's lines (its page's excerpt) follow the file."""
    test_file = tmp_path / "tests" / "test_edited.py"
    test_file.parent.mkdir()
    test_file.write_text("def test_it():\n    assert True\n")
    assert evidence_of(Context(tmp_path), "tests/test_edited.py::test_it").lines == (1, 2)
    test_file.write_text("import os\n\n\ndef test_it():\n    assert os.sep\n")
    assert evidence_of(Context(tmp_path), "tests/test_edited.py::test_it").lines == (4, 5)


HELPED = """\
import pytest


def run_upstream():
    return build()


def build():
    return 1


def unused():
    pass


@pytest.mark.upstream("up")
def test_runs_upstream():
    assert run_upstream() == 1
"""


def test_a_test_page_links_the_files_functions_the_test_reaches(project):
    """The function that runs upstream is shown and linked from the test, and its own callees from it, in file
    order; a function no cited test reaches is not shown."""
    write_tests(project.root, text=HELPED)
    (project.root / "reading_notes" / "a.md.j2").write_text(
        FREE_FORM + "{{ verified_by('tests/test_claims.py::test_runs_upstream') }}\n"
    )
    assert project.run("render").code == 0
    page = (project.root / "docs" / "notes" / "tests" / "test_claims.md").read_text()
    assert "hide:\n  - navigation\n  - toc\n" in page  # the code gets the page's width: 120-column lines fit
    test = page.split("## `test_runs_upstream`", 1)[1].split("\n## ", 1)[0]
    assert "Cited by: [a](../a.md). Calls: [`run_upstream`](#calls.run_upstream).\n" in test
    helpers = page.split("\n## What the tests call\n", 1)[1]
    assert [line for line in helpers.split("\n") if line.startswith("### ")] == [
        "### `run_upstream` { #calls.run_upstream }",
        "### `build` { #calls.build }",
    ]
    assert "L4–L5. Calls: [`build`](#calls.build).\n" in helpers
    assert '```python linenums="8"\ndef build():\n    return 1\n```' in helpers

"""render: notes become Markdown with verified excerpts; failures name file:line and leave the old output."""

import os

from tests.tools.conftest import FREE_FORM

LAYERS = "up:pkg/core/layers.py"


def note(project, name, text):
    path = project.root / "reading_notes" / name
    path.write_text(FREE_FORM + text)
    return path


def rendered(project, name):
    return (project.root / "docs" / "notes" / name).read_text()


def test_excerpt_keeps_upstream_numbers_highlight_and_symbol(project):
    assert project.run("cite", f"{LAYERS}::ColumnParallel.forward").code == 0
    note(
        project, "layers.md.j2", "# Layers\n\n{{ cite('" + LAYERS + "::ColumnParallel.forward', highlight='L14-L15') }}"
    )
    r = project.run("render")
    assert r.code == 0, r.err
    md = rendered(project, "layers.md")
    assert '```python linenums="12" hl_lines="3-4"\n    @staticmethod\n' in md
    assert "L12–L15 · `ColumnParallel.forward`" in md


def test_fence_is_longer_than_any_backtick_run_in_the_excerpt(project):
    assert project.run("cite", "up:pkg/core/ticks.py#L1-L7").code == 0
    note(project, "ticks.md.j2", "{{ cite('up:pkg/core/ticks.py#L1-L7') }}\n")
    assert project.run("render").code == 0
    md = rendered(project, "ticks.md")
    assert '\n`````python linenums="1"\n' in md and md.rstrip().endswith("`````")


def test_unchanged_notes_are_not_rewritten(project):
    assert project.run("cite", f"{LAYERS}#L9-L10").code == 0
    note(project, "a.md.j2", "{{ cite('" + LAYERS + "#L9-L10') }}\n")
    assert project.run("render").code == 0
    out = project.root / "docs" / "notes" / "a.md"
    os.utime(out, (1, 1))
    r = project.run("render", "--json")
    assert r.json() == {"changed": []} and out.stat().st_mtime == 1


def test_out_folder_outside_the_project_lists_absolute_paths(project, tmp_path):
    assert project.run("cite", f"{LAYERS}#L9-L10").code == 0
    note(project, "a.md.j2", "{{ cite('" + LAYERS + "#L9-L10') }}\n")
    out = tmp_path / "elsewhere"
    r = project.run("render", "--out", str(out), "--json")
    assert r.code == 0, r.err
    assert str(out / "a.md") in r.json()["changed"] and (out / "a.md").is_file()


def test_failures_name_file_and_line_and_keep_previous_output(project):
    assert project.run("cite", f"{LAYERS}#L9-L10").code == 0
    note(project, "a.md.j2", "{{ cite('" + LAYERS + "#L9-L10') }}\n")
    assert project.run("render").code == 0
    before = rendered(project, "a.md")
    cases = [
        (
            "x\n\n{{ cite('" + LAYERS + "#L1-L2') }}\n",
            "reading_notes/a.md.j2:6: up:pkg/core/layers.py#L1-L2 is not in the lock",
        ),
        ("x\n{% if %}\n", "reading_notes/a.md.j2:5: "),
        (
            "x\n\n\n{{ verified_by('tests/tools/test_render.py::test_nope') }}\n",
            "reading_notes/a.md.j2:7: verified_by: test file 'tests/tools/test_render.py' does not exist under tests/",
        ),
        ("{{ cite('" + LAYERS + "#L9-L10', highlight='L1-L2') }}\n", "highlight L1-L2 lies outside the cited L9-L10"),
        ("{{ undefined_thing }}\n", "reading_notes/a.md.j2:4: 'undefined_thing' is undefined"),
    ]
    for text, message in cases:
        note(project, "a.md.j2", text)
        r = project.run("render")
        assert r.code == 2 and message in r.err and r.err.count("\n") == 1, (text, r.err)
        assert rendered(project, "a.md") == before


def test_check_fails_when_a_named_test_does_not_exist(project):
    (project.root / "tests").mkdir()
    (project.root / "tests" / "test_claims.py").write_text("def test_real():\n    assert True\n")
    note(
        project,
        "claims.md.j2",
        "{{ verified_by('tests/test_claims.py::test_real') }}\n\n"
        "{{ verified_by('tests/test_claims.py::test_gone') }}\n",
    )
    r = project.run("check")
    assert r.code == 1
    assert (
        "reading_notes/claims.md.j2:6: tests/test_claims.py::test_gone: tests/test_claims.py has no test test_gone"
        in r.out
    )
    assert "test_real" not in r.out


def test_an_excerpt_with_blank_first_or_last_lines_names_the_range_to_cite(project):
    """Pygments drops them, so the page's line numbers would disagree with the caption (found in the browser)."""
    assert project.run("cite", f"{LAYERS}#L2-L4", f"{LAYERS}#L3-L5").code == 0
    for spec, better in ((f"{LAYERS}#L2-L4", "L2-L2"), (f"{LAYERS}#L3-L5", "L5-L5")):
        note(project, "a.md.j2", "text\n{{ cite('" + spec + "') }}\n")
        r = project.run("render")
        assert r.code == 2 and r.err.count("\n") == 1
        assert (
            f"reading_notes/a.md.j2:5: {spec} starts or ends with a blank line, which the page cannot number "
            f"correctly; cite {better}" in r.err
        )


def test_a_line_range_caption_names_the_definition_holding_it(project):
    assert project.run("cite", f"{LAYERS}#L14-L15", f"{LAYERS}#L2-L2").code == 0
    note(project, "a.md.j2", "{{ cite('" + LAYERS + "#L14-L15') }}\n{{ cite('" + LAYERS + "#L2-L2') }}\n")
    assert project.run("render").code == 0
    md = rendered(project, "a.md")
    assert "L14–L15 · in `ColumnParallel.forward` @" in md and "L2–L2 @" in md  # module level: no name

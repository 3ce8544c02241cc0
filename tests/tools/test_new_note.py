"""`new-note` starts a close reading whose first `check` lists exactly what its author must fill, and which
passes once they have; it refuses a taken or unsafe name and leaves nothing half-written."""

from __future__ import annotations

import re
import shlex
import shutil

from tests.tools.conftest import ROOT, ProjectDir
from tests.tools.test_note_rules import write_claims

PAGE = ROOT / "docs" / "adding-a-note.md"


def page_command(verb: str) -> list[str]:
    """The arguments of the `tools/pin-and-cite VERB ...` command docs/adding-a-note.md shows, as written."""
    line = next(line for line in PAGE.read_text().split("\n") if line.startswith(f"tools/pin-and-cite {verb} "))
    return shlex.split(line.split("  #", 1)[0])[1:]


def test_the_skeleton_fails_check_exactly_where_the_author_must_write(project):
    args = page_command("new-note")
    name = args[1]
    r = project.run(*args)
    assert r.code == 0 and r.out == f"wrote reading_notes/{name}.md.j2; `tools/pin-and-cite check` lists what to fill\n"
    note = project.root / "reading_notes" / f"{name}.md.j2"
    text = note.read_text()
    headings = [n for n, line in enumerate(text.split("\n"), 1) if line.startswith("### ")]
    connect = text.split("\n").index("## Connect the dots") + 1
    r = project.run("check")
    assert r.code == 1
    assert r.out.split("\n")[:-2] == [
        f"reading_notes/{name}.md.j2:1: note rules: 0 cited design choice(s) ('### ' sections with cite()); "
        "a close reading needs at least 5",
        *(
            f"reading_notes/{name}.md.j2:{line}: note rules: design choice 'Choice {i}' "
            "cites no upstream lines; add cite(...)"
            for i, line in enumerate(headings, 1)
        ),
        f"reading_notes/{name}.md.j2:{connect}: note rules: 'Connect the dots' prints no measured number: "
        "render it from a trace with {{ ... }}, never type it",
    ]

    # Filled in as the comments say, the note keeps its rules: the skeleton imposes nothing more.
    assert project.run("cite", "up:pkg/core/layers.py#L9-L10").code == 0
    write_claims(project.root)
    filled = re.sub(
        r"\{# Rename the heading.*?#\}",
        lambda _: (
            " ".join(["word"] * 51)
            + "\n{{ cite('up:pkg/core/layers.py#L9-L10') }}\n"
            + "{{ verified_by('tests/test_claims.py::test_runs_upstream') }}"
        ),
        text,
        flags=re.S,
    )
    note.write_text(re.sub(r"\{# A number from a recorded run.*?#\}", "{{ 6 * 7 }} bytes.", filled, flags=re.S))
    r = project.run("check")
    assert r.code == 0, r.out
    assert project.run("render").code == 0
    assert (project.root / "docs" / "notes" / f"{name}.md").read_text().count(" ".join(["word"] * 51)) == 5


def test_a_taken_or_unsafe_name_is_refused_and_nothing_is_written(project):
    notes = project.root / "reading_notes"
    assert project.run("new-note", "mine", "--title", "Mine").code == 0
    before = (notes / "mine.md.j2").read_bytes()
    for args, message in (
        (["mine", "--title", "Other"], "reading_notes/mine.md.j2 already exists; choose another name"),
        (["../up", "--title", "x"], "note name '../up': use lowercase letters, digits and '-' (e.g. tensor-sharding)"),
        (["Mine", "--title", "x"], "note name 'Mine': use lowercase letters"),
        (["other", "--title", "{{ 7 }}"], "--title '{{ 7 }}': give a title without '{' or '}'"),
        (["other", "--title", "  "], "--title '': give a title without"),
    ):
        r = project.run("new-note", *args)
        assert r.code == 2 and r.err.startswith(f"pin-and-cite: error: {message}") and r.err.count("\n") == 1, r.err
    assert (notes / "mine.md.j2").read_bytes() == before
    left = sorted(p.name for p in notes.iterdir() if p.name != ".pin-and-cite.lock")  # the write lock, git-ignored
    assert left == ["mine.md.j2", "pins.toml"]  # no temporary file left
    r = project.run("new-note", "--help")
    assert r.code == 0 and "Refuses a name already taken" in r.out and "mkdocs.yml nav" in r.out


def test_the_page_cites_a_new_file_offline_from_the_pinned_wheel(tmp_path):
    """The page's `cite --trust-distribution`, as written, in a copy of this project's notes: no network."""
    project = ProjectDir(tmp_path / "project", tmp_path / "cache")
    shutil.copytree(ROOT / "reading_notes", project.root / "reading_notes", dirs_exist_ok=True)
    args = page_command("cite")
    spec = next(arg for arg in args if ":" in arg)
    r = project.run(*args, "--json")
    assert r.code == 0, r.err
    lock = __import__("json").loads(project.lock_path.read_text())
    path = spec.split(":", 1)[1].split("::", 1)[0]
    assert lock["files"][f"pytorch:{path}"]["resolved_from"].startswith("distribution torch")

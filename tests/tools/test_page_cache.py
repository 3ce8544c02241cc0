"""The page cache (pin_and_cite.site.page_cache) lets a warm `check` or build skip running a template whose
inputs are as they were, and never shows a page those inputs would not make: an edit to the code ours()
shows, to a test verified_by() names or to anything in the notes folder renders the page again; an edit to
another note leaves this one's entry alone; a planted entry changes nothing; and the study's helpers read
nothing the entry does not cover."""

import hashlib
import hmac
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools.conftest import FREE_FORM

ROOT = Path(__file__).resolve().parents[2]
NOTE_A = (
    FREE_FORM
    + "# A\n\n{{ ours('reference/mod.py::f') }}\n\n{{ verified_by('tests/test_claims.py::test_real') }}\n\n"
    + '{% include "_part.md.j2" %}\n'
)


@pytest.fixture
def notes(project):
    (project.root / "reference").mkdir()
    (project.root / "reference" / "mod.py").write_text("def f():\n    return 1\n")
    (project.root / "tests").mkdir()
    (project.root / "tests" / "test_claims.py").write_text("def test_real():\n    pass\n")
    (project.root / "reading_notes" / "a.md.j2").write_text(NOTE_A)
    (project.root / "reading_notes" / "_part.md.j2").write_text("partial one\n")
    (project.root / "reading_notes" / "b.md.j2").write_text(FREE_FORM + "# B\n")
    return project


def _render(project) -> str:
    run = project.run("render")
    assert run.code == 0, run.out + run.err
    return (project.root / "docs" / "notes" / "a.md").read_text()


def _entries(project) -> dict[Path, dict]:
    """Each kept page's entry file -> its stored page, tests and reads."""
    return {e: json.loads(json.loads(e.read_text())["text"]) for e in (project.cache / "pages").rglob("*.json")}


def _entry_of_a(project) -> Path:
    [entry] = [e for e, kept in _entries(project).items() if kept["page"].startswith(FREE_FORM + "# A")]
    return entry


def test_a_kept_page_is_used_only_while_what_it_read_is_as_it_was(notes):
    cold = _render(notes)
    assert "return 1" in cold and "partial one" in cold and "test_real" in cold
    entry = _entry_of_a(notes)
    assert _entries(notes)[entry]["read"].keys() == {"reference/mod.py", "tests/test_claims.py"}
    assert _entries(notes)[entry]["cited"] == ["tests/test_claims.py::test_real"]
    assert _render(notes) == cold and len(_entries(notes)) == 2  # read, not made again

    (notes.root / "reading_notes" / "b.md.j2").write_text(FREE_FORM + "# B, edited\n")
    assert _render(notes) == cold
    assert entry in _entries(notes) and len(_entries(notes)) == 3  # b's new entry; a's is the same one

    (notes.root / "reference" / "mod.py").write_text("def f():\n    return 2\n")
    assert "return 2" in _render(notes)
    (notes.root / "reading_notes" / "_part.md.j2").write_text("partial two\n")
    assert "partial two" in _render(notes)
    (notes.root / "tests" / "test_claims.py").write_text("def test_renamed():\n    pass\n")
    run = notes.run("render")
    assert run.code == 2 and "has no test test_real" in run.err, run.err


def test_the_test_pages_still_list_a_kept_page_as_citing(notes):
    _render(notes)
    test_page = notes.root / "docs" / "notes" / "tests" / "test_claims.md"
    cold = test_page.read_text()
    assert "a.md" in cold
    test_page.unlink()
    _render(notes)
    assert test_page.read_text() == cold


@pytest.mark.parametrize("forge", ["no-mac", "other-key", "other-page", "garbage"])
def test_a_planted_page_changes_nothing(notes, forge):
    cold = _render(notes)
    entry = _entry_of_a(notes)
    stored = json.loads(entry.read_bytes())
    planted = {**stored, "text": json.dumps({"page": "<script>planted</script>", "cited": [], "read": {}})}
    if forge == "other-key":  # a MAC made with some other key
        planted["mac"] = hmac.new(
            b"k" * 32, (stored["made_from"] + planted["text"]).encode(), hashlib.sha256
        ).hexdigest()
    if forge == "other-page":  # b's genuine entry under a's name
        [other] = [e for e in _entries(notes) if e != entry]
        planted = json.loads(other.read_bytes())
    entry.write_bytes(b"\x80{" if forge == "garbage" else json.dumps(planted).encode())
    assert _render(notes) == cold
    assert json.loads(entry.read_bytes()) == stored  # rendered afresh and kept again


READS = """
import json, os, sys
from pathlib import Path
opened = set()
def note(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)) and os.path.isabs(args[0]):
        opened.add(os.path.normpath(os.fspath(args[0])))
from pin_and_cite.core.project import Project
from pin_and_cite.site.render import Renderer, pages
project = Project(Path(sys.argv[1]))
renderer, named = Renderer(project), set()
sys.addaudithook(note)
for template, context, page in pages(project):
    renderer.page = page
    renderer.render(template, **context)
    named |= set(renderer._read)
print(json.dumps({"opened": sorted(opened), "named": sorted(named)}))
"""


def test_the_study_pages_read_only_the_notes_folder_and_the_files_they_name(tmp_path):
    """What the cache's key and reads do not cover would serve a stale page: every file of the checkout the
    study's pages open, rendered with a cold cache, is in the notes folder, the tool's code, or named."""
    env = {**os.environ, "PIN_AND_CITE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": f"{ROOT / 'tools'}:{ROOT}"}
    run = subprocess.run([sys.executable, "-c", READS, str(ROOT)], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout)
    named = {str(ROOT / path) for path in found["named"]}
    assert any(p.startswith(str(ROOT / "reference")) for p in named)  # ours() and verified_by() were recorded
    outside = [
        p
        for p in found["opened"]
        if Path(p).is_relative_to(ROOT)
        and not Path(p).is_relative_to(sys.prefix)  # installed sources: the lock holds their blob SHAs
        and not Path(p).is_relative_to(ROOT / "reading_notes")
        and not (Path(p).is_relative_to(ROOT / "tools") and (p.endswith(".py") or os.path.isdir(p)))
        and p not in named
    ]
    assert outside == []

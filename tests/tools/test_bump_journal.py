"""`bump` writes pins, lock and templates as one step even when killed: a journal written before the first
rename lets the next run that writes the project roll the write back (killed while staging) or forward (killed
after the commit mark), so the project is never a mix of old and new files, and no staged file is left
behind; `check` meanwhile refuses and touches nothing."""

import shutil

import pytest

from tests.tools.test_bump import noted, snapshot  # noqa: F401  (noted: a fixture pytest finds by name)

KILL = "PIN_AND_CITE_TEST_KILL_AT_RENAME"
JOURNAL = ".pin-and-cite-journal.json"


def restore(project, files: dict) -> None:
    notes = project.root / "reading_notes"
    shutil.rmtree(notes)
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


@pytest.mark.usefixtures("noted")
def test_a_bump_killed_at_any_rename_is_rolled_back_or_forward_by_the_next_writer(project, tmp_path):
    before = snapshot(project)
    assert project.run("bump", "up", "--ref", "c2").code == 0
    after = snapshot(project)
    assert after != before
    outcomes = []
    for rename in range(20):
        restore(project, before)
        r = project.run("bump", "up", "--ref", "c2", env={KILL: str(rename)})
        if r.code == 0:  # no rename left to kill at
            break
        assert r.code == -9, r.err
        interrupted = snapshot(project)
        assert interrupted not in (before, after)  # the kill really interrupted the write
        r = project.run("check")  # read-only: says so, and recovers nothing
        if JOURNAL in {p.name for p in interrupted}:
            assert r.code == 2 and "holds an interrupted write" in r.err and "render" in r.err, r.err
        assert snapshot(project) == interrupted
        r = project.run("render", "--out", str(tmp_path / f"out{rename}"))  # a verb that writes recovers first
        assert snapshot(project) in (before, after), f"a mix of old and new files after a kill at rename {rename}"
        outcomes.append("old" if snapshot(project) == before else "new")
        assert r.err.startswith(
            f"pin-and-cite: {'rolled back' if outcomes[-1] == 'old' else 'completed'} an "
            f"interrupted write of 3 file(s) in {project.root / 'reading_notes'}\n"
        ) or (outcomes[-1] == "old" and r.err == ""), r.err
        r = project.run("check")
        assert r.code == (0 if outcomes[-1] == "old" else 1), r.err  # after the bump, a renamed symbol is broken
    # two journal renames (staging, committed), then pins, lock and the template
    assert outcomes == ["old", "old", "new", "new", "new"]
    assert snapshot(project) == after


@pytest.mark.usefixtures("noted")
def test_a_journal_naming_files_outside_the_project_is_refused(project, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    journal = project.root / "reading_notes" / JOURNAL
    journal.write_text('{"state": "staging", "files": [["../../victim", "../../victim", "' + "0" * 64 + '"]]}')
    r = project.run("render")
    assert r.code == 2
    assert r.err.startswith(f"pin-and-cite: error: {journal} is not a pin-and-cite journal (entry ")
    assert len(r.err.splitlines()) == 1
    assert victim.read_text() == "keep me"

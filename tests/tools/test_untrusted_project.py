"""A branch's files cannot make `check` write, unpickle or follow anything (issue 23): the cache stays outside
the checkout and holds nothing compiled, only a verb that writes the project recovers a journal, and it holds
the write lock that lives in the project; pins cannot aim `render` at another file; symlinks lead nowhere.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import select
import subprocess
import sys
import time

import filelock
import jinja2
import pytest

from pin_and_cite.core import project as project_module
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.site.render import render_notes
from tests.tools.conftest import CLI, FREE_FORM, ROOT, Run
from tests.tools.test_untrusted_input import CITE, locked, one_error_line, run

JOURNAL = ".pin-and-cite-journal.json"
HOLD_THE_WRITE_LOCK = """
import sys
from pathlib import Path
from pin_and_cite.core.write_lock import write_lock
with write_lock(Path(sys.argv[2])):
    print("held", flush=True)
    sys.stdin.read()
"""


def _note(project, text: str = "{{ cite('" + CITE + "') }}\n", name: str = "a.md.j2"):
    locked(project)
    (project.root / "reading_notes" / name).write_text(FREE_FORM + text)


def _files(folder) -> dict:
    """Every file's bytes but the write lock's (empty, made by the first writer)."""
    return {
        p: p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and not p.is_symlink() and p.name != ".pin-and-cite.lock"
    }


# -- 1. nothing unpickled from the cache; no cache inside the checkout ------------------------------------


class _Plant:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_check_unpickles_nothing_from_the_cache(project, tmp_path):
    """Jinja's bytecode cache read `<cache>/jinja/<version>/__jinja2_<key>.cache` with pickle.load."""
    _note(project)
    marker = tmp_path / "pwned"
    notes = project.root / "reading_notes"
    key = jinja2.bccache.BytecodeCache().get_cache_key("a.md.j2", os.path.normpath(notes / "a.md.j2"))
    folder = project.cache / "jinja" / jinja2.__version__
    folder.mkdir(parents=True)
    (folder / f"__jinja2_{key}.cache").write_bytes(jinja2.bccache.bc_magic + pickle.dumps(_Plant(str(marker))))
    r = run(project, "check")
    assert r.code == 0, r.err
    assert not marker.exists()


@pytest.mark.parametrize("verb", ["check", "fetch", "render"])
def test_a_cache_inside_the_project_is_refused(project, verb):
    _note(project)
    inside = project.root / ".pcache"
    r = project.run(verb, env={"PIN_AND_CITE_CACHE": str(inside)})
    assert one_error_line(r) == (
        f"pin-and-cite: error: cache {inside} is inside the project ({project.root}); "
        "point PIN_AND_CITE_CACHE at a directory outside it\n"
    )
    assert not inside.exists()


def test_a_relative_cache_or_one_inside_the_checkout_of_the_current_directory_is_refused(project, tmp_path):
    _note(project)
    checkout = tmp_path / "their-checkout"
    (checkout / ".git").mkdir(parents=True)
    for cache, reason in [(".pcache", "is relative"), (str(checkout / "c"), "inside the checkout")]:
        proc = subprocess.run(
            [str(CLI), "check", "--project", str(project.root)],
            capture_output=True,
            text=True,
            cwd=checkout,
            env={**os.environ, "PIN_AND_CITE_CACHE": cache},
        )
        assert reason in one_error_line(Run(proc.returncode, proc.stdout, proc.stderr))
    assert list(checkout.iterdir()) == [checkout / ".git"]


# -- 2. check recovers no journal and writes nothing ------------------------------------------------------


def test_check_never_swaps_in_a_committed_journal(project):
    _note(project)
    notes = project.root / "reading_notes"
    hidden = notes / ".a.md.j2.abcdef01.tmp"
    hidden.write_text("nothing cited here\n")
    (notes / JOURNAL).write_text(json.dumps({"state": "committed", "files": [[hidden.name, "a.md.j2"]]}))
    before = _files(project.root)
    err = one_error_line(run(project, "check"))
    assert "interrupted write" in err and "render" in err
    assert _files(project.root) == before


@pytest.mark.parametrize("verb", ["check", "render"])
@pytest.mark.parametrize("plant", ["dev-zero", "fifo"])
def test_a_journal_that_is_not_a_regular_file_is_one_line(project, verb, plant):
    _note(project)
    journal = project.root / "reading_notes" / JOURNAL
    journal.symlink_to("/dev/zero") if plant == "dev-zero" else os.mkfifo(journal)
    err = one_error_line(run(project, verb))
    assert JOURNAL in err


def test_a_staged_file_that_is_not_regular_is_refused(project, tmp_path):
    _note(project)
    notes = project.root / "reading_notes"
    staged = notes / ".a.md.j2.abcdef01.tmp"
    staged.symlink_to(tmp_path / "outside")
    (notes / JOURNAL).write_text(json.dumps({"state": "committed", "files": [[staged.name, "a.md.j2", "0" * 64]]}))
    err = one_error_line(run(project, "render"))
    assert staged.name in err
    assert staged.is_symlink() and (notes / "a.md.j2").read_text().startswith(FREE_FORM + "{{ cite(")


# -- 3. one write lock, in the project; a roll forward that cannot finish says so ---------------------------


def test_writers_with_different_caches_take_turns_on_the_project(project, tmp_path):
    """The lock lived in the cache: a run with another cache went ahead (and recovered a live bump's journal)."""
    _note(project)
    notes = project.root / "reading_notes"
    other_cache = tmp_path / "other-cache"
    with filelock.FileLock(str(notes / ".pin-and-cite.lock")):  # a bump with the usual cache, writing
        proc = subprocess.Popen(
            [str(CLI), "cite", CITE, "--project", str(project.root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PIN_AND_CITE_CACHE": str(other_cache)},
        )
        time.sleep(2)
        assert proc.poll() is None, proc.communicate()  # waits for the lock
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def test_a_writer_waiting_on_the_lock_says_whom_it_waits_for(project):
    """A render behind a writer stopped with SIGSTOP waited in silence until it was killed."""
    _note(project)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_WRITE_LOCK, "holding-for-the-test", str(project.root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tools")},
    )
    assert holder.stdout.readline() == "held\n"
    waiter = project.popen("render")
    ready, _, _ = select.select([waiter.stderr], [], [], 60)  # a bound on a hang, not on speed
    line = waiter.stderr.readline() if ready else "(nothing said in 60 s)"
    assert line.startswith("pin-and-cite: waiting for ") and ".pin-and-cite.lock" in line, line
    assert f"held by pid {holder.pid} (-c holding-for-the-test);" in line, line  # program and verb only
    assert "Ctrl-C stops waiting" in line and f"kill -CONT {holder.pid}" in line, line
    assert waiter.poll() is None
    holder.communicate("")  # releases the lock
    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, err
    assert "waiting" not in err  # said once


def test_the_write_lock_is_ignored_by_git():
    from tests.tools.conftest import ROOT

    proc = subprocess.run(
        ["git", "check-ignore", "-q", "reading_notes/.pin-and-cite.lock"], cwd=ROOT, capture_output=True
    )
    assert proc.returncode == 0


def test_a_folder_planted_as_the_write_lock_is_one_line(project):
    _note(project)
    (project.root / "reading_notes" / ".pin-and-cite.lock").unlink()
    (project.root / "reading_notes" / ".pin-and-cite.lock").mkdir()
    assert ".pin-and-cite.lock is a folder" in one_error_line(run(project, "cite", CITE))


def test_a_roll_forward_with_a_staged_file_gone_fails_loudly(project):
    _note(project)
    notes = project.root / "reading_notes"
    note = notes / "a.md.j2"
    before = note.read_bytes()
    staged_sha = "1" * 64  # what the killed write staged: not what the note holds
    (notes / JOURNAL).write_text(
        json.dumps({"state": "committed", "files": [[".a.md.j2.abcdef01.tmp", "a.md.j2", staged_sha]]})
    )
    err = one_error_line(run(project, "render"))
    assert "is gone" in err and "does not hold what the journal" in err
    assert note.read_bytes() == before and (notes / JOURNAL).exists()


# -- 4. sha_file names only a *-sha.txt file of reading_notes ----------------------------------------------


@pytest.mark.parametrize(
    "sha_file", ["citations.lock", "pins.toml", "a.md.j2", "megatron-sha.txt\\n", "../x-sha.txt", "MEGATRON-SHA.TXT"]
)
def test_sha_file_cannot_name_another_project_file(project, upstream, sha_file):
    _note(project)
    notes = project.root / "reading_notes"
    project.pins_path.write_text(
        f'[sources.up]\nurl = "{upstream.url}"\ncommit = "{upstream.v1}"\nsha_file = "{sha_file}"\n'
    )
    before = _files(notes)
    err = one_error_line(run(project, "render"))
    assert "sha_file" in err
    assert _files(notes) == before


def test_two_sources_cannot_share_a_sha_file(project, upstream):
    _note(project)
    table = f'url = "{upstream.url}"\ncommit = "{upstream.v1}"\nsha_file = "up-sha.txt"\n'
    project.pins_path.write_text(f"[sources.up]\n{table}\n[sources.up2]\n{table}")
    assert "same sha_file" in one_error_line(run(project, "check"))


# -- 7. symlinks at the top of the project; an interrupted or concurrent render --------------------------


@pytest.mark.parametrize("swapped", ["template", "folder"])
def test_a_template_swapped_for_a_symlink_after_the_check_is_refused_in_one_line(
    project, tmp_path, monkeypatch, swapped
):
    """A racer renamed a symlink out onto a template between the check of reading_notes/ and Jinja's read of
    it, and render put the outside file on a page: a template is read through one descriptor, checked once."""
    _note(project)
    notes, outside = project.root / "reading_notes", tmp_path / "outside"
    outside.mkdir()
    (outside / "x.md.j2").write_text(FREE_FORM + "SECRET\n")
    if swapped == "template":
        (notes / "a.md.j2").unlink()
        (notes / "a.md.j2").symlink_to(outside / "x.md.j2")
    else:
        (notes / "a.md.j2").write_text(FREE_FORM + '{% include "sub/x.md.j2" %}\n')
        (notes / "sub").symlink_to(outside)
    monkeypatch.setattr(project_module, "refuse_special_files", lambda notes_dir: None)  # the swap came after it
    monkeypatch.setenv("PIN_AND_CITE_CACHE", str(project.cache))
    out = tmp_path / "pages"
    with pytest.raises(PinAndCiteError) as refused:
        render_notes(project.root, out)
    link = notes / ("a.md.j2" if swapped == "template" else "sub")
    assert f"{link} is a symlink, not a regular file" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert not any(b"SECRET" in data for data in _files(out).values())


def test_reading_notes_as_a_symlink_is_refused(project, tmp_path):
    _note(project)
    notes = project.root / "reading_notes"
    outside = tmp_path / "outside-notes"
    notes.rename(outside)
    notes.symlink_to(outside)
    assert "reading_notes is a symlink" in one_error_line(run(project, "check"))


@pytest.mark.parametrize("link", ["docs", "docs/notes", "--out"])
def test_render_never_writes_through_a_symlinked_output_folder(project, tmp_path, link):
    _note(project)
    outside = tmp_path / "outside"
    outside.mkdir()
    args = ["render"]
    if link == "--out":
        (tmp_path / "out-link").symlink_to(outside)
        args += ["--out", str(tmp_path / "out-link")]
    else:
        (project.root / link).parent.mkdir(parents=True, exist_ok=True)
        (project.root / link).symlink_to(outside)
    assert "is a symlink" in one_error_line(run(project, *args))
    assert list(outside.iterdir()) == []


def test_render_into_what_is_not_a_folder_is_one_line(project, tmp_path):
    _note(project)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "is not a folder" in one_error_line(run(project, "render", "--out", str(fifo)))


@pytest.mark.parametrize("link", ["reference", "reference/x.py"])
@pytest.mark.parametrize("verb", ["check", "render"])
def test_ours_never_reads_through_a_symlink(project, tmp_path, link, verb):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.py").write_text("def Secret():\n    pass\n")
    _note(project, "{{ ours('reference/x.py::Secret') }}\n")
    if link == "reference":
        (project.root / "reference").symlink_to(outside)
    else:
        (project.root / "reference").mkdir()
        (project.root / "reference" / "x.py").symlink_to(outside / "x.py")
    r = run(project, verb)
    assert r.code != 0 and "Traceback" not in r.err, (r.out, r.err)
    assert "is a symlink" in r.err + r.out and "Secret` (reference" not in r.out


def test_render_takes_over_the_pages_of_its_own_interrupted_run(project, tmp_path):
    """A render stopped between two pages (here: a file-size limit the last, large page exceeds) left pages
    no manifest listed: once a template changed, every later render refused them as someone else's."""
    _note(project)
    notes = project.root / "reading_notes"
    (notes / "z.md.j2").write_text(FREE_FORM + "z" * 200_000 + "\n")
    out = tmp_path / "out"

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    proc = subprocess.run(
        [str(CLI), "render", "--out", str(out), "--project", str(project.root)],
        capture_output=True,
        text=True,
        preexec_fn=small_files,
        env={**os.environ, "PIN_AND_CITE_CACHE": str(project.cache)},
    )
    assert proc.returncode != 0 and (out / "a.md").exists() and not (out / "z.md").exists(), proc.stderr
    (notes / "a.md.j2").write_text(FREE_FORM + "edited after the interruption\n")
    r = run(project, "render", "--out", str(out))
    assert r.code == 0, r.err
    assert (out / "a.md").read_text() == FREE_FORM + "edited after the interruption\n" and (out / "z.md").exists()


RENDERS = 4


def test_concurrent_renders_into_a_new_folder_all_succeed(project, tmp_path):
    _note(project)
    for n in range(200):  # pages written while another run looks for foreign ones
        (project.root / "reading_notes" / f"p{n:03}.md.j2").write_text(f"{FREE_FORM}page {n}\n")
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        procs = [
            subprocess.Popen(
                [str(CLI), "render", "--out", str(out), "--project", str(project.root)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PIN_AND_CITE_CACHE": str(project.cache)},
            )
            for _ in range(RENDERS)
        ]
        results = [(p.wait(timeout=120), p.communicate()[1]) for p in procs]
        assert [code for code, _ in results] == [0] * RENDERS, results


@pytest.mark.parametrize("link", ["tests", "file"])
def test_verified_by_never_reads_a_test_file_through_a_symlink(project, tmp_path, link):
    """A branch's `tests/test_x.py -> ~/.ssh/id_rsa` (or `tests -> /`) named in verified_by(): check read it and
    the site showed it on the test's evidence page."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "test_x.py").write_text("def test_secret():\n    pass\n")
    _note(project, "{{ verified_by('tests/test_x.py::test_secret') }}\n")
    if link == "tests":
        (project.root / "tests").symlink_to(outside)
    else:
        (project.root / "tests").mkdir()
        (project.root / "tests" / "test_x.py").symlink_to(outside / "test_x.py")
    for verb in ("check", "render"):
        r = run(project, verb)
        assert r.code != 0 and "Traceback" not in r.err, (r.out, r.err)
        assert "is a symlink; tests are read from plain files only" in r.err + r.out
    assert not (project.root / "docs" / "notes" / "tests").exists()

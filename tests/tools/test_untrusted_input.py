"""`check` on a hostile branch (issue 12): a crafted lock, pins, template, out folder or cache entry gets one
escaped line and an exit status, and nothing outside the cache or the output folder is read, written or run.

The CLI runs here under a 1 GiB address-space limit, so a regression that reads /dev/zero fails with a
MemoryError instead of eating the machine.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess

import git
import pytest

from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.store import Store
from tests.tools.conftest import CLI, FREE_FORM, Run

LAYERS = "up:pkg/core/layers.py"
CITE = f"{LAYERS}#L9-L10"


def run(project, *args: str, timeout: float = 120) -> Run:
    """The CLI as ProjectDir.run runs it, with bounded memory; a hang fails the test after `timeout`."""

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    proc = subprocess.run(
        [str(CLI), *args, "--project", str(project.root)],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit_memory,
        cwd=project.root,
        env={**os.environ, "PIN_AND_CITE_CACHE": str(project.cache)},
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def one_error_line(r: Run, code: int = 2) -> str:
    assert r.code == code, (r.code, r.out, r.err)
    assert r.err.startswith("pin-and-cite: error: ") and r.err.count("\n") == 1, r.err
    assert "Traceback" not in r.err
    return r.err


def locked(project) -> dict:
    assert project.run("cite", CITE).code == 0
    return json.loads(project.lock_path.read_text())


def write_lock(project, data) -> None:
    project.lock_path.write_text(json.dumps(data))


def cache_entry(project, lock: dict):
    blob = lock["files"]["up:pkg/core/layers.py"]["blob"]
    return project.cache / "blobs" / blob[:2] / blob[2:]


# -- the tool runs its own code, never the checkout's -----------------------------------------------------


def test_check_in_a_checkout_imports_nothing_from_it(project, tmp_path):
    """`python -m` would put the working directory first on sys.path: a branch's git.py or reference/
    would then run in place of the library or the tool's own reference package."""
    marker = tmp_path / "pwned"
    for module in ("git.py", "jsonschema.py", "reference/__init__.py"):
        (project.root / module).parent.mkdir(parents=True, exist_ok=True)
        (project.root / module).write_text(f"open({str(marker)!r}, 'a').write('{module}\\n')\n")
    r = run(project, "check")
    assert r.code == 0, r.err
    assert not marker.exists(), marker.read_text()


@pytest.mark.parametrize(
    "name, target", [("evil.md.j2", "secret"), ("traces/big.json", "/dev/zero"), ("citations.lock", "secret")]
)
def test_check_reads_no_file_outside_the_project_through_a_symlink(project, tmp_path, name, target):
    secret = tmp_path / "secret"
    secret.write_text("{{ 'outside' }}\n")
    link = project.root / "reading_notes" / name
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(secret if target == "secret" else target)
    err = one_error_line(run(project, "check"))
    assert f"{name} is a symlink" in err


# -- 1. SHAs name cache paths only when they are SHAs; the lock and pins have a schema ---------------------


@pytest.mark.parametrize("verb", ["check", "fetch"])
def test_a_blob_that_is_a_path_deletes_nothing(project, tmp_path, verb):
    lock = locked(project)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    lock["files"]["up:pkg/core/layers.py"]["blob"] = ".." + str(victim)  # blob[2:] is then absolute
    write_lock(project, lock)
    err = one_error_line(run(project, verb))
    assert "citations.lock" in err and "files" in err and "blob" in err
    assert victim.read_text() == "precious\n"


def test_the_store_names_paths_only_by_full_shas(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    store = Store(tmp_path / "cache")
    for bad in (".." + str(victim), "../../victim", "A" * 40, "0" * 39):
        with pytest.raises(PinAndCiteError, match="not a full 40-hex"):
            store.get(bad)
    assert victim.read_text() == "precious\n"


def _set(path: tuple, value):
    def tamper(lock: dict) -> dict:
        target = lock
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return lock

    return tamper


BUMP = {
    "old_commit": "a" * 40,
    "new_commit": "b" * 40,
    "tag": None,
    "counts": {"unchanged": 1, "moved": 0, "changed": 1, "deleted": 0},
    "files": {"pkg/core/layers.py": {"old_blob": "c" * 40, "new_blob": None}},
    "changes": {},
}


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda lock: [lock], id="list-at-top"),
        pytest.param(_set(("files",), []), id="files-as-list"),
        pytest.param(_set(("files", "up:pkg/core/layers.py", "blob"), 7), id="integer-blob"),
        pytest.param(_set(("files", "up:pkg/core/layers.py", "blob"), "F" * 40), id="uppercase-blob"),
        pytest.param(_set(("files", "up:pkg/core/layers.py", "commit"), "v1"), id="tag-as-commit"),
        pytest.param(_set(("files", "up:pkg/core/layers.py", "size"), "big"), id="string-size"),
        pytest.param(_set(("citations", f"{CITE}", "lines"), "9-10"), id="string-lines"),
        pytest.param(_set(("citations", f"{CITE}", "text_sha256"), None), id="null-text-hash"),
        pytest.param(_set(("version",), "1"), id="string-version"),
        pytest.param(_set(("bumps",), {"up": {**BUMP, "old_commit": "../../x" + "0" * 33}}), id="bump-commit-path"),
        pytest.param(
            _set(("bumps",), {"up": {**BUMP, "files": {"p": {"old_blob": "/etc/passwd", "new_blob": None}}}}),
            id="bump-blob-path",
        ),
        pytest.param(_set(("bumps",), {"up": {**BUMP, "counts": []}}), id="bump-counts-list"),
    ],
)
def test_a_tampered_lock_is_one_line(project, tamper):
    write_lock(project, tamper(locked(project)))
    err = one_error_line(run(project, "check"))
    assert "citations.lock" in err and "restore it from git" in err


def test_a_lock_with_defaults_and_cross_file_records_loads(project):
    """The schema takes every field the lock writes: parameter defaults, a bump's defaults, a recorded file
    absent at the old commit."""
    lock = locked(project)
    lock["defaults"] = {f"{LAYERS}::ColumnParallel.forward(x)": {"value": "None", "line": 14}}
    change = {
        "status": "changed",
        "old_lines": [9, 10],
        "old_text_sha256": "d" * 64,
        "new_lines": [3, 4],
        "new_text_sha256": "e" * 64,
        "new_cite": None,
        "cited_at": ["reading_notes/a.md.j2:1"],
    }
    lock["bumps"] = {
        "up": {
            **BUMP,
            "old_commit": lock["files"]["up:pkg/core/layers.py"]["commit"],
            "files": {"pkg/core/other.py": {"old_blob": None, "new_blob": "c" * 40}},
            "changes": {CITE: change},
            "defaults": {f"{LAYERS}::ColumnParallel.forward(x)": {"old_value": "1", "new_value": None}},
        }
    }
    write_lock(project, lock)
    r = run(project, "check")
    assert r.code == 1 and r.err == "" and "bump record of up" in r.out, (r.out, r.err)


@pytest.mark.parametrize(
    "pins",
    [
        pytest.param(b'sources = "x"\n', id="sources-as-string"),
        pytest.param(b"sources = [1, 2]\n", id="sources-as-list"),
        pytest.param(b"[sources.up]\nurl = 1\ncommit = 2\n", id="integer-fields"),
        pytest.param(b'[sources.up]\nurl = "git://h/x"\ncommit = "' + b"A" * 40 + b'"\n', id="uppercase-commit"),
        pytest.param(
            b'[sources.up]\nurl = "git://h/x"\ncommit = "' + b"a" * 40 + b'"\nbranch = "main"\n', id="unknown-key"
        ),
        pytest.param(b"\xff\xfe[sources]\x00\x81\n", id="binary"),
    ],
)
def test_tampered_pins_are_one_line(project, pins):
    project.pins_path.write_bytes(pins)
    err = one_error_line(run(project, "check"))
    assert "pins.toml" in err


# -- 2. templates render in a sandbox --------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        "{{ cycler.__init__.__globals__.os.popen('touch MARKER') }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ self.__init__.__globals__.__builtins__.open('MARKER', 'w') }}",
        "{{ pins.up.__class__.__init__.__globals__.os.system('touch MARKER') }}",
    ],
)
@pytest.mark.parametrize("verb", ["render", "check"])
def test_a_template_cannot_run_code(project, tmp_path, payload, verb):
    marker = tmp_path / "pwned"
    (project.root / "reading_notes" / "evil.md.j2").write_text(
        FREE_FORM + "# Evil\n\n" + payload.replace("MARKER", str(marker))
    )
    r = run(project, verb)
    assert r.code != 0 and "Traceback" not in r.err, (r.out, r.err)
    assert "unsafe" in r.err + r.out or "undefined" in r.err + r.out
    assert not marker.exists()


def test_a_template_cannot_change_what_check_compares(project):
    """A note that empties the pins in memory must not hide that megatron-sha.txt disagrees with them."""
    project.write_pins(
        **{"megatron-lm": {"url": "git://127.0.0.1:9/m.git", "commit": "a" * 40, "sha_file": "megatron-sha.txt"}}
    )
    (project.root / "reading_notes" / "megatron-sha.txt").write_text("b" * 40 + "\n")
    (project.root / "reading_notes" / "quiet.md.j2").write_text(
        FREE_FORM + "{{ pins.clear() }}{{ pins.pop('megatron-lm') }}\n"
    )
    r = run(project, "check")
    assert r.code == 1 and "megatron-sha.txt says" in r.out, (r.out, r.err)


# -- 3. render removes only what it wrote ----------------------------------------------------------------


def _note(project):
    locked(project)
    (project.root / "reading_notes" / "a.md.j2").write_text(FREE_FORM + "{{ cite('" + CITE + "') }}\n")


def test_render_into_a_folder_with_other_markdown_is_refused(project):
    _note(project)
    readme = project.root / "README.md"
    readme.write_text("# The project\n")
    (project.root / "docs").mkdir()
    (project.root / "docs" / "index.md").write_text("# Home\n")
    err = one_error_line(run(project, "render", "--out", "."))
    assert "README.md" in err and "did not write" in err
    assert readme.read_text() == "# The project\n" and (project.root / "docs" / "index.md").exists()
    assert not (project.root / "a.md").exists()


def test_the_site_folder_of_a_render_before_the_manifest_is_taken_over_but_never_a_foreign_page(project, tmp_path):
    """docs/notes from a render that kept no manifest (the site's build output, which git ignores) holds older
    versions of render's own pages: taken as render's there, and only there; any other Markdown is refused."""
    _note(project)
    out = project.root / "docs" / "notes"
    out.mkdir(parents=True)
    (out / "a.md").write_text("an older render of a\n")
    assert run(project, "render").code == 0 and (out / "a.md").read_text() != "an older render of a\n"
    (out / ".pin-and-cite-pages.json").unlink()
    (out / "a.md").write_text("an older render of a\n")
    (out / "mine.md").write_text("my own page\n")
    err = one_error_line(run(project, "render"))
    assert "mine.md" in err and "did not write" in err and (out / "a.md").read_text() == "an older render of a\n"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "a.md").write_text("someone's a.md\n")
    err = one_error_line(run(project, "render", "--out", str(elsewhere)))
    assert "a.md" in err and (elsewhere / "a.md").read_text() == "someone's a.md\n"


def test_render_removes_the_pages_it_wrote_and_nothing_else(project, tmp_path):
    _note(project)
    (project.root / "reading_notes" / "b.md.j2").write_text(FREE_FORM + "b\n")
    assert run(project, "render").code == 0
    out = project.root / "docs" / "notes"
    assert (out / "b.md").is_file()
    (project.root / "reading_notes" / "b.md.j2").unlink()
    r = run(project, "render", "--json")
    assert r.code == 0 and not (out / "b.md").exists() and (out / "a.md").is_file(), r.err
    [manifest] = [p for p in out.iterdir() if p.name.startswith(".")]
    victim = tmp_path / "victim.md"
    victim.write_text("precious\n")
    manifest.write_text(json.dumps(["a.md", "../../../victim.md", str(victim)]))
    run(project, "render")
    assert victim.read_text() == "precious\n"


def test_render_never_writes_through_a_symlinked_folder(project, tmp_path):
    _note(project)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = project.root / "docs" / "notes"
    out.mkdir(parents=True)
    (out / "sources").symlink_to(elsewhere)
    (project.root / "reading_notes" / "_source.md.j2").write_text(FREE_FORM + "# {{ source.name }}\n")
    err = one_error_line(run(project, "render"))
    assert "outside" in err and "sources" in err
    assert list(elsewhere.iterdir()) == []


# -- 4. cache entries that are not regular files ---------------------------------------------------------


def _fifo(path):
    os.mkfifo(path)


def _dev_zero(path):
    path.symlink_to("/dev/zero")


def _loop(path):
    path.symlink_to(path)


def _directory(path):
    path.mkdir()


@pytest.mark.parametrize("plant", [_fifo, _dev_zero, _loop, _directory], ids=["fifo", "dev-zero", "loop", "dir"])
def test_a_cache_entry_that_is_not_a_regular_file_is_refused(project, plant):
    entry = cache_entry(project, locked(project))
    entry.unlink()
    plant(entry)
    r = run(project, "check")
    assert r.code == 1 and "Traceback" not in r.err, (r.out, r.err)
    assert "not a regular file" in r.out
    one_error_line(run(project, "fetch"), code=3)


def test_a_cache_entry_larger_than_its_blob_is_never_read(project):
    entry = cache_entry(project, locked(project))
    with open(entry, "r+b") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB that reading would allocate
    r = run(project, "check")
    assert r.code == 1 and "Traceback" not in r.err, (r.out, r.err)
    assert "not fetched" in r.out
    assert run(project, "fetch").code == 0 and run(project, "check").code == 0


# -- 5. what is echoed from input is escaped -------------------------------------------------------------


def test_an_error_naming_a_spoofed_path_stays_one_line(project):
    r = run(project, "cite", "up:pkg/\u202eyp.evil\nfake: all good.py#L1-L2")
    err = one_error_line(r)
    assert "\u202e" not in err and "\\u202e" in err and "\\n" in err


def test_check_escapes_citations_it_reports(project):
    (project.root / "reading_notes" / "a.md.j2").write_text(
        FREE_FORM + "{{ cite('up:pkg/\u202eok\\n0 broken.py#L1-L2') }}\n"
    )
    r = run(project, "check")
    assert r.code == 1, r.err
    problems = r.out.splitlines()[:-1]
    assert len(problems) == 1 and "\u202e" not in r.out and "\\u202e" in problems[0], r.out


# -- 9. pin records commits only -------------------------------------------------------------------------


def test_pin_peels_an_annotated_tag_to_its_commit(project, upstream):
    tag_object = git.Repo(upstream.path).tags["v1"].tag.hexsha
    assert tag_object != upstream.v1
    r = run(project, "pin", "up", "--ref", tag_object, "--json")
    assert r.code == 0, r.err
    assert r.json()["commit"] == upstream.v1
    assert f'commit = "{upstream.v1}"' in project.pins_path.read_text()


@pytest.mark.parametrize("kind", ["blob", "tree"])
def test_pin_refuses_what_is_not_a_commit(project, upstream, kind):
    commit = git.Repo(upstream.path).commit(upstream.v1)
    sha = commit.tree["pkg/core/layers.py"].hexsha if kind == "blob" else commit.tree["pkg"].hexsha
    before = project.pins_path.read_text()
    err = one_error_line(run(project, "pin", "up", "--ref", sha))
    assert f"{sha} is a {kind}, not a commit" in err
    assert project.pins_path.read_text() == before


def test_an_uppercase_sha_is_refused_by_name(project, upstream):
    err = one_error_line(run(project, "pin", "up", "--ref", upstream.v2.upper()))
    assert "lowercase" in err

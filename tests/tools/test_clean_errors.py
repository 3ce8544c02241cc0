"""Inputs and conditions that once ended in a traceback: each is now one line on stderr and the documented
exit status (2 bad input, 4 a local file could not be written, 130 interrupted), and nothing is half-written."""

import errno
import os
import signal
import subprocess
from pathlib import Path

import pytest

from pin_and_cite.core.context import Context
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.local_code import definition
from pin_and_cite.core.parse_cache import ParseCache
from tests.tools.conftest import CLI, FREE_FORM, ProjectDir, interruptible


def one_line(r, code: int) -> str:
    assert r.code == code and r.err.count("\n") == 1 and r.err.startswith("pin-and-cite"), (r.code, r.err)
    return r.err


@pytest.mark.parametrize(
    "content, message",
    [
        (
            b'def f():\n    return "\xff"\n',
            "ours('reference/x.py::f'): reference/x.py is not UTF-8 (byte 0xff at offset 21)",
        ),
        (b"x = " + b"-" * 200_000 + b"1\n", "reference/x.py nests too deeply for Python's parser"),
    ],
)
def test_ours_on_a_file_python_cannot_read_is_one_clear_error(tmp_path, content, message):
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "x.py").write_bytes(content)
    with pytest.raises(PinAndCiteError) as error:
        definition(Context(tmp_path, ParseCache(tmp_path / "cache")), "reference/x.py::f")
    assert message in str(error.value)


def test_a_template_that_includes_itself_is_one_line(project):
    (project.root / "reading_notes" / "loop.md.j2").write_text(FREE_FORM + '# Loop\n\n{% include "loop.md.j2" %}\n')
    err = one_line(project.run("render", "--out", "out"), 2)
    assert err == (
        "pin-and-cite: error: reading_notes/loop.md.j2:6: templates include or extend each other without end; "
        "that page was left as it was, the others rendered\n"
    )


ASCII_LOCALE = {"PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0", "LC_ALL": "C", "LANG": "C"}


@pytest.mark.parametrize(
    "body, env, message",
    [
        pytest.param("# Café ‘quoted’ — π\n", ASCII_LOCALE, None, id="utf-8-note-in-an-ascii-locale"),
        pytest.param(b"\xff\xfe\n", {}, "bad.md.j2:4: the template is not UTF-8 text", id="undecodable"),
        pytest.param(
            "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}\n", {}, "bad.md.j2:?: the template nests too deep", id="deep"
        ),
    ],
)
@pytest.mark.parametrize("verb", ["check", "render"])
def test_a_template_is_read_as_utf_8_and_one_python_cannot_parse_is_one_line(project, body, env, message, verb):
    """N27, N36, N2: `check` read templates in the locale's encoding (a UnicodeDecodeError under LC_ALL=C),
    and an undecodable or deeply nested template was a traceback."""
    template = project.root / "reading_notes" / "bad.md.j2"
    head = FREE_FORM.encode()
    template.write_bytes(head + (body if isinstance(body, bytes) else body.encode()))
    r = project.run(verb, env=env)
    if message is None:
        assert r.code == 0 and "Traceback" not in r.err, r.err
    else:
        assert message in one_line(r, 2)


def test_record_traces_into_a_file_is_one_line_before_anything_runs(tmp_path):
    """N24: `--out /dev/null` was a FileExistsError traceback, after the recording it came at the end of."""
    proc = subprocess.run(
        [str(CLI.parent / "record-traces"), "--out", "/dev/null", "--only", "layout_grid"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr == "record-traces: error: --out /dev/null is not a folder\n", proc


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-5", "1e12"])
def test_a_timeout_that_is_not_a_positive_finite_number_is_refused_at_parse_time(project, value):
    err = one_line(project.run("check", f"--timeout={value}"), 2)
    assert f"argument --timeout: expected seconds in (0, 86400], got '{value}'" in err


def test_a_cache_variable_naming_a_file_or_a_missing_parent_is_refused(project, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for cache, message in (
        (a_file, f"PIN_AND_CITE_CACHE='{a_file}' is not a directory"),
        (a_file / "sub", f"{a_file} is not a directory"),
        (tmp_path / "missing" / "cache", f"{tmp_path / 'missing'} is not a directory"),
    ):
        for args in (
            ["check"],
            ["cite", "up:pkg/core/layers.py#L1-L2"],
            ["relocate", "--source", str(tmp_path), "--from", "a", "--to", "b", "x.py#L1-L2"],
        ):
            r = (
                project.run(*args, env={"PIN_AND_CITE_CACHE": str(cache)})
                if args[0] != "relocate"
                else _run_cli(args, cache)
            )
            assert message in one_line(r, 2)
    assert not (tmp_path / "missing").exists()


def _run_cli(args, cache: Path):
    from tests.tools.conftest import Run

    proc = subprocess.run(
        [str(CLI), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PIN_AND_CITE_CACHE": str(cache)},
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.parametrize("loading", ["jinja2", "pin_and_cite.core.project", "pin_and_cite.check"])
def test_ctrl_c_while_the_libraries_load_is_one_line_and_exit_130(project, loading):
    """Ctrl-C as the module `loading` has just been imported (Python's -X importtime, on stderr, says when),
    not after a delay: on busy cores the tool may load before or after any fixed delay."""
    proc = subprocess.Popen(
        [str(CLI), "check", "--project", str(project.root)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PIN_AND_CITE_CACHE": str(project.cache), "PYTHONPROFILEIMPORTTIME": "1"},
        preexec_fn=interruptible,
    )
    for line in proc.stderr:
        if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == loading:
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=60)[1]
    err = "".join(line + "\n" for line in rest.splitlines() if not line.startswith("import time:"))
    assert proc.returncode == 130 and err.count("\n") == 1 and err.startswith("pin-and-cite: interrupted"), err


# -- a full disk ---------------------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs (root only): writes there end in a real ENOSPC once `fill` has used the space."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk: Path) -> None:
    with open(disk / "filler", "wb", buffering=0) as out:
        for chunk in (4096, 1):
            try:
                while True:
                    out.write(b"x" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC


def files_of(root: Path) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != "filler"}


def test_a_full_disk_during_cite_bump_or_render_is_one_line_and_leaves_the_files_intact(tiny_disk, history, tmp_path):
    project = ProjectDir(tiny_disk / "project", tmp_path / "cache")
    project.write_pins(up={"url": history.url, "commit": history.c1})
    note = project.root / "reading_notes" / "mod.md.j2"
    note.write_text(FREE_FORM + "# Mod\n\n{{ cite('up:pkg/mod.py#L12-L14') }}\n")
    assert project.run("cite", "up:pkg/mod.py#L12-L14").code == 0
    fill(tiny_disk)
    before = files_of(tiny_disk)
    for args in (["cite", "up:pkg/mod.py#L17-L19"], ["bump", "up", "--ref", "c2"], ["render", "--out", "out"]):
        err = one_line(project.run(*args), 4)
        assert "No space left on device" in err, err
        assert files_of(tiny_disk) == before, args

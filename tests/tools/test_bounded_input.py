"""Bounded work on a hostile branch (issue 23): templates, blobs, installed files, string fields, nesting and
long paths each cost at most a bound, and going past it is one line and an exit status, never a hang, a
memory blow-up or a traceback.

The CLI runs under test_untrusted_input's 1 GiB address-space limit and a timeout, so a regression fails
instead of eating the machine.
"""

from __future__ import annotations

import json
import re

import pytest

from pin_and_cite.cli import main
from pin_and_cite.core import sandbox
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.project import Project
from pin_and_cite.site import render
from pin_and_cite.site.render import Renderer
from tests.tools.conftest import FREE_FORM
from tests.tools.test_untrusted_input import CITE, locked, one_error_line, run, write_lock

# -- templates: bounded in CPU and memory ------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload, refusal",
    [
        pytest.param("{{ 9**(9**9) }}", "too large", id="power"),
        pytest.param('{{ "a" * 10**10 }}', "needs more than", id="repeat-string"),
        pytest.param("{{ [1, 2] * 10**10 }}", "needs more than", id="repeat-list"),
        pytest.param(
            "{% set x = 2**10000 %}" + "{% set x = x * -x %}" * 30 + "{{ x > 0 }}", "too large", id="square-integers"
        ),
        pytest.param(
            "{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(60) }}",
            "calls and loop turns",
            id="exponential-macro",
        ),
        pytest.param('{{ "a"|center(2000000000) }}', "needs more than", id="filter-sized-by-argument"),
        pytest.param('{{ "%2000000000d"|format(1) }}', "needs more than", id="format-width"),
        pytest.param('{% set s = "a" * 1000000 %}{{ s|replace("a", s) }}', "needs more than", id="replace"),
        pytest.param('{% set s = "a" * 1000000 %}' + "{% set s = s ~ s %}" * 12, "needs more than", id="concat"),
        pytest.param(
            '{% set s = "ab" * 400000 %}{% for a in s %}{{ s|list|length }}{% endfor %}',
            "s of CPU",
            id="work-in-each-loop-turn",
        ),
    ],
)
def test_a_template_that_would_not_end_or_fill_memory_is_one_line(project, payload, refusal):
    (project.root / "reading_notes" / "evil.md.j2").write_text(FREE_FORM + "# Evil\n\n" + payload + "\n")
    err = one_error_line(run(project, "render", timeout=60))
    assert "reading_notes/evil.md.j2:6: " in err and refusal in err, err


@pytest.mark.parametrize(
    "payload, refusal",
    [
        pytest.param('{{ "%300000000d"|format(1) }}', "format() needs more than", id="format-width"),
        pytest.param('{{ "%.300000000f"|format(1) }}', "format() needs more than", id="format-precision"),
        pytest.param('{{ "{:*>300000000}".format(1) }}', "format() needs more than", id="str-format-width"),
        pytest.param('{{ "a".ljust(300000000) }}', "ljust() needs more than", id="string-method"),
        pytest.param('{{ "a"|indent(300000000, true) }}', "indent() needs more than", id="indent"),
        pytest.param('{{ "a" * 300000000 }}', "a repeat needs more than", id="repeat"),
    ],
)
@pytest.mark.parametrize("verb", ["render", "check"])
def test_a_width_or_count_past_the_bound_is_refused_before_anything_is_made(project, payload, refusal, verb):
    """Jinja calls a filter on constants while it compiles the page, before any render bound applies, and
    writes the value into the compiled code (`"%2000000000d"|format(1)` cost a `check` 176 s and 9.8 GB, then
    passed): a width or count over MAX_TEXT is refused before the filter, method or repeat runs."""
    (project.root / "reading_notes" / "evil.md.j2").write_text(FREE_FORM + "# Evil\n\n" + payload + "\n")
    r = run(project, verb, timeout=60)
    err = one_error_line(r) if verb == "render" else r.out
    assert r.code != 0 and "reading_notes/evil.md.j2:6: " in err and refusal in err, (r.out, r.err)


def _renderer(project) -> Renderer:
    return Renderer(Project(project.root, cache_dir=project.cache))


def test_jinja_compiles_a_page_within_the_page_bounds(project, monkeypatch):
    """What constant folding makes from a constant (here a list of two million items from a 2 MB string) is
    made while the page compiles, so the compile runs within the page's memory bound too (here 16 MiB)."""
    monkeypatch.setattr(sandbox, "MAX_MEMORY", 16 << 20)
    template = project.root / "reading_notes" / "fold.md.j2"
    template.write_text(FREE_FORM + '{{ "' + "a" * 2_000_000 + '"|list }}\n')
    # The line is known when the overrun comes in the render, not when Jinja folds the constant while compiling
    with pytest.raises(PinAndCiteError, match=r"fold\.md\.j2:(4|\?): the page needs more than 16 MiB"):
        _renderer(project).render(template)


def test_the_pages_of_one_run_share_one_cpu_budget(project, monkeypatch, capsys):
    """Twelve pages each spending their own 5 s once cost a `check` 61 s: the run stops, in one line naming
    the page and line, once all its pages have spent MAX_RUN_SECONDS together."""
    monkeypatch.setattr(sandbox, "MAX_SECONDS", 1)
    monkeypatch.setattr(sandbox, "MAX_RUN_SECONDS", 1.5)
    monkeypatch.setenv("PIN_AND_CITE_CACHE", str(project.cache))
    burn = '{% set s = "a" * 10000000 %}{% for i in "x" * 40000 %}{{ s.count("b") }}{% endfor %}\n'
    for n in range(4):
        (project.root / "reading_notes" / f"burn{n}.md.j2").write_text(FREE_FORM + burn)
    assert main(["check", "--project", str(project.root)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"pin-and-cite: error: reading_notes/burn1\.md\.j2:4: the pages of this run take more "
        r"than 1\.5 s of CPU in all\n",
        err,
    ), err


def test_the_pages_of_one_run_are_bounded_in_number(project, monkeypatch):
    monkeypatch.setattr(render, "MAX_PAGES", 2)
    for n in range(3):
        (project.root / "reading_notes" / f"page{n}.md.j2").write_text(FREE_FORM + "a page\n")
    with pytest.raises(PinAndCiteError, match="reading_notes makes 3 pages, over the bound of 2"):
        render.render_notes(project.root, project.root / "docs" / "notes")


def test_a_bounded_template_still_renders_its_numbers(project):
    (project.root / "reading_notes" / "fine.md.j2").write_text(
        FREE_FORM + "{{ 2**10 }} {{ 2**-1 }} {{ 2.5**2 }} {{ 'ab' * 3 }} {{ 3 * 'ab' }} {{ -4 * 5 }} {{ [1] + [2] }}\n"
    )
    assert run(project, "render").code == 0
    page = (project.root / "docs" / "notes" / "fine.md").read_text()
    assert page == FREE_FORM + "1024 0.5 6.25 ababab ababab -20 [1, 2]\n"


# -- blobs from a remote, files from an installed distribution ------------------------------------------------


def test_fetch_reads_no_more_of_a_blob_than_the_lock_says_it_holds(project):
    lock = locked(project)
    entry = lock["files"]["up:pkg/core/layers.py"]
    entry["size"] = 10  # the remote's blob is larger than the lock records
    write_lock(project, lock)
    empty_cache(project)
    err = one_error_line(run(project, "fetch"), code=3)
    assert f"{entry['blob'][:12]}" in err and "10 bytes" in err, err
    assert not (project.cache / "blobs" / entry["blob"][:2] / entry["blob"][2:]).exists()


@pytest.fixture
def installed(tmp_path, monkeypatch, project):
    """A distribution `planted 1.0` on PYTHONPATH whose RECORD lists a 3 GiB (sparse) file at a cited path
    and a file outside its folder; the project pins it as the source's distribution."""
    site = tmp_path / "site"
    big = site / "pkg" / "core" / "big.so"
    big.parent.mkdir(parents=True)
    with big.open("wb") as f:
        f.truncate(3 << 30)
    (tmp_path / "secret").write_text("secret\n")
    info = site / "planted-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: planted\nVersion: 1.0\n")
    (info / "RECORD").write_text("pkg/core/big.so,,\n../secret,,\nplanted-1.0.dist-info/METADATA,,\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    text = project.pins_path.read_text()
    project.pins_path.write_text(text + 'distribution = "planted==1.0"\n')
    return site


def empty_cache(project) -> None:
    for blob in (project.cache / "blobs").rglob("*"):
        if blob.is_file():
            blob.unlink()


def test_an_installed_file_is_read_no_further_than_the_locked_size(project, installed):
    lock = locked(project)
    entry = lock["files"].pop("up:pkg/core/layers.py")
    lock["files"]["up:pkg/core/big.so"] = entry  # layers.py's blob, said to be at the path of the 3 GiB file
    write_lock(project, lock)
    empty_cache(project)
    r = run(project, "fetch")
    assert r.code == 0 and "Traceback" not in r.err, (r.out, r.err)
    assert "other bytes for pkg/core/big.so" in r.out + r.err


@pytest.mark.parametrize("key", ["up:../secret", "up:pkg/../../secret", "up:/etc/passwd", "Up:pkg/x.py"])
def test_a_lock_key_that_is_not_a_repository_path_is_refused(project, installed, key):
    lock = locked(project)
    lock["files"][key] = lock["files"]["up:pkg/core/layers.py"]
    write_lock(project, lock)
    empty_cache(project)
    for verb in ("check", "fetch"):
        err = one_error_line(run(project, verb))
        assert "citations.lock" in err and "restore it from git" in err, err


# -- string fields and files of bounded size ----------------------------------------------------------------


def test_a_huge_url_in_pins_is_one_line(project):
    text = project.pins_path.read_text().replace('url = "', 'url = "' + "x" * 100_000, 1)
    project.pins_path.write_text(text)
    err = one_error_line(run(project, "check"))
    assert "pins.toml" in err and "url" in err, err


def test_a_huge_pins_file_is_refused_before_it_is_parsed(project):
    project.pins_path.write_text(project.pins_path.read_text() + "# " + "x" * (2 << 20) + "\n")
    err = one_error_line(run(project, "check"))
    assert "pins.toml" in err and "larger than" in err, err


@pytest.mark.parametrize("field", ["resolved_from", "symbol"])
def test_a_huge_string_in_the_lock_is_one_line(project, field):
    lock = locked(project)
    if field == "symbol":
        lock["citations"][CITE]["symbol"] = "x" * 100_000
    else:
        lock["files"]["up:pkg/core/layers.py"]["resolved_from"] = "x" * 100_000
    write_lock(project, lock)
    err = one_error_line(run(project, "check"))
    assert "citations.lock" in err and field in err and len(err) < 400, err


# -- nesting ------------------------------------------------------------------------------------------------


def test_a_deeply_nested_lock_is_one_line(project):
    lock = locked(project)
    text = json.dumps(lock)
    project.lock_path.write_text(text[:-1] + ', "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    err = one_error_line(run(project, "check"))
    assert "citations.lock" in err and "nested" in err, err


def test_deeply_nested_pins_are_one_line(project):
    project.pins_path.write_text(project.pins_path.read_text() + "x = " + "[" * 50_000 + "]" * 50_000 + "\n")
    err = one_error_line(run(project, "check"))
    assert "pins.toml" in err and "nested" in err, err


# -- a long path in ours() is that citation's problem, not the run's -----------------------------------------


def test_a_path_too_long_for_the_file_system_is_one_problem_and_the_rest_is_checked(project):
    assert project.run("cite", CITE).code == 0
    (project.root / "reading_notes" / "a.md.j2").write_text(
        FREE_FORM + '{{ ours("reference/' + "a" * 6000 + '.py::X") }}\n'
    )
    (project.root / "reading_notes" / "b.md.j2").write_text(
        FREE_FORM + "{{ cite('" + CITE + "') }}\n{{ undefined_name }}\n"
    )
    r = run(project, "check")
    assert r.code == 1 and r.err == "", (r.code, r.out, r.err)
    assert "reading_notes/a.md.j2:4" in r.out and "too long" in r.out
    assert "reading_notes/b.md.j2:5" in r.out  # the next template was rendered too


def test_a_huge_file_in_the_notes_folder_is_refused_before_it_is_read(project):
    """A 50 MB template once took a `check` 21 s and 350 MB; no file of ours in reading_notes/ is near 16 MiB."""
    (project.root / "reading_notes" / "big.md.j2").write_text(FREE_FORM + "# Big\n\n" + "word " * (4 << 20) + "\n")
    err = one_error_line(run(project, "check"))
    assert "big.md.j2" in err and "larger than 16 MiB" in err, err


def test_a_locked_size_over_the_blob_bound_is_refused(project):
    """The lock's size bounds every read of its blob, so a lock cannot lift the bound by claiming 1.5 GB."""
    lock = locked(project)
    lock["files"]["up:pkg/core/layers.py"]["size"] = 1_500_000_000
    write_lock(project, lock)
    err = one_error_line(run(project, "fetch"))
    assert "citations.lock" in err and "size" in err, err

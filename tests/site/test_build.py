"""The real site builds strictly, serves the pinned mermaid, and its files fetch nothing from other hosts."""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import shutil
import subprocess
import sys

import pytest
from material.plugins.search.plugin import Parser
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

from pin_and_cite.site.search_text import without_code_spans
from tests.site.conftest import ROOT, mkdocs_env, vendor_assets
from tests.site.external_refs import external_refs

BUNDLE = re.compile(r"assets/javascripts/bundle\.[0-9a-f]+\.min\.js")
# Fallbacks inside mkdocs-material's own bundle. Each is a code path the site never takes, for the reason
# given; the browser test loads every page with such requests blocked and recorded. Listed exactly so that any new URL
# fails.
MATERIAL_FALLBACKS = {
    "https://unpkg.com/mermaid@11/dist/mermaid.min.js": "loaded only when window.mermaid is undefined; "
    "extra_javascript defines it first",
    "https://unpkg.com/resize-observer-polyfill": "loaded only by browsers without ResizeObserver",
    "https://api.github.com/repos/${e}/${t}": "repository facts, fetched only when repo_url is set",
    "https://api.github.com/users/${e}": "repository facts, fetched only when repo_url is set",
    "https://${e}/api/v4/projects/${encodeURIComponent(t)}": "GitLab facts, fetched only when repo_url is set",
}


def test_built_site_fetches_nothing_from_other_hosts(built_site):
    found = external_refs(built_site)
    unexplained = [ref for ref in found if not (BUNDLE.fullmatch(ref.file) and ref.url in MATERIAL_FALLBACKS)]
    assert unexplained == [], "built files would fetch from other hosts:\n" + "\n".join(map(str, unexplained))
    # Positive control: the scanner does see the fallbacks it excuses, so it is reading the real bundle.
    assert {ref.url for ref in found} == set(MATERIAL_FALLBACKS)


def test_config_keeps_material_off_its_cdns():
    config = load_config(config_file=str(ROOT / "mkdocs.yml"))
    assert config.theme["font"] is False, "web fonts would load from fonts.googleapis.com"
    assert config.repo_url is None, "material would fetch repository facts from api.github.com"
    assert "material/offline" not in config.plugins, "material's offline plugin adds an unpkg.com script"
    assert "navigation.instant" not in config.theme["features"], (
        "instant navigation would reach a page with diagrams from one whose mermaid script the site hook dropped"
    )
    scripts = [str(script) for script in config.extra_javascript]
    assert {asset.dest for asset in vendor_assets.load_lock()} <= set(scripts), "vendored scripts must be loaded"


def test_built_site_serves_the_pinned_mermaid_before_material_needs_it(built_site):
    (mermaid,) = [a for a in vendor_assets.load_lock() if a.name == "mermaid"]
    served = (built_site / mermaid.dest).read_bytes()
    assert hashlib.sha512(served).hexdigest() == mermaid.file_sha512
    html = (built_site / "notes" / "synthesis" / "index.html").read_text()  # a page with diagrams
    scripts = re.findall(r'<script src="([^"]+)"', html)
    assert scripts.index(f"../../{mermaid.dest}") > 0, scripts
    # A plain (not deferred, not module) script: it defines window.mermaid before DOMContentLoaded,
    # which is when material decides whether to fetch its CDN copy.
    assert f'<script src="../../{mermaid.dest}"></script>' in html
    # A page without diagrams does not load it (material fetches mermaid only for a page that has some).
    assert '<pre class="mermaid">' not in (home := (built_site / "index.html").read_text())
    assert "mermaid.min.js" not in home


def _index_sections(html: str) -> list[tuple[str, str, str | None]]:
    """What mkdocs-material's search makes of a page's HTML: each section's title, text and anchor."""
    parser = Parser()
    parser.feed(html)
    parser.close()
    return [("".join(s.title), "".join(s.text), s.id) for s in parser.data]


def test_search_reads_the_same_text_without_the_highlighters_spans(built_site):
    """site_hooks hands material's search each page without the span tags, empty line anchors and line numbers
    inside <pre> blocks: on every page material's own parser must index exactly what it indexes from the full
    HTML, and the page keeps its spans."""
    article = re.compile(r'<article class="md-content__inner md-typeset">(.*?)</article>', re.S)
    pages = sorted(built_site.rglob("index.html"))
    shortened, highlighted = 0, 0
    for page in pages:
        (content,) = article.findall(page.read_text())
        short = without_code_spans(content)
        assert _index_sections(short) == _index_sections(content), page.relative_to(built_site)
        shortened += short != content
        highlighted += re.search(r'class="[^"]*\bhighlight', content) is not None  # Pygments' block or table
    assert shortened == highlighted > 15, "every page with highlighted code is read without its spans"
    note = (built_site / "notes" / "fsdp-prefetch" / "index.html").read_text()
    assert '<span class="n">' in note, "the page itself must keep the highlighting"
    index = json.loads((built_site / "search" / "search_index.json").read_text())
    assert any("_pre_backward_hook" in doc["text"] for doc in index["docs"]), "code in excerpts stays searchable"


@pytest.mark.parametrize("damage", ["missing", "altered"])
def test_build_stops_with_one_line_reason_without_verified_mermaid(vendored_docs, tmp_path, caplog, damage):
    docs = tmp_path / "docs"
    shutil.copytree(vendored_docs, docs)
    (mermaid,) = [a for a in vendor_assets.load_lock() if a.name == "mermaid"]
    if damage == "missing":
        (docs / mermaid.dest).unlink()
    else:
        with open(docs / mermaid.dest, "ab") as f:
            f.write(b"\n// edited\n")
    config = load_config(config_file=str(ROOT / "mkdocs.yml"), docs_dir=str(docs), site_dir=str(tmp_path / "site"))
    with pytest.raises(Abort, match="BuildError"):
        build(config)
    (message,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]  # what the CLI prints
    assert "\n" not in message and "run tools/vendor-assets" in message
    assert ("is missing" if damage == "missing" else "does not match the sha512 pinned for mermaid@") in message
    assert not (tmp_path / "site" / "index.html").exists()


def _files(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_pending_bump_journal_stops_the_build_in_one_line_naming_render(vendored_docs, tmp_path, caplog, monkeypatch):
    """A bump killed mid-write left a journal: the hook rendered the half-written project (and rewrote
    megatron-sha.txt) where `tools/pin-and-cite render` finishes or undoes the write first."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "reading_notes", project / "reading_notes", ignore=shutil.ignore_patterns(".*.lock"))
    journal = project / "reading_notes" / ".pin-and-cite-journal.json"
    journal.write_text('{"state": "staging", "files": []}')
    notes_before = _files(project / "reading_notes")
    docs = tmp_path / "docs"
    shutil.copytree(vendored_docs, docs, ignore=shutil.ignore_patterns("notes"))
    monkeypatch.setenv("PIN_AND_CITE_PROJECT", str(project))
    config = load_config(config_file=str(ROOT / "mkdocs.yml"), docs_dir=str(docs), site_dir=str(tmp_path / "site"))
    with pytest.raises(Abort):
        build(config)
    (error,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "\n" not in error and "holds an interrupted write" in error, error
    assert "run `tools/pin-and-cite render` to finish or undo it, then mkdocs build again" in error, error
    assert not (docs / "notes").exists()
    left = _files(project / "reading_notes")
    assert left.pop(".pin-and-cite.lock") == b""  # taken, then released
    assert left == notes_before


def test_a_build_waits_for_a_writer_holding_the_write_lock(vendored_docs, tmp_path):
    """`mkdocs build` took no lock, so it rendered beside a running bump; now it waits its turn, says for
    whom, and then (here) finds the journal that writer left."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "reading_notes", project / "reading_notes", ignore=shutil.ignore_patterns(".*.lock"))
    (project / "reading_notes" / ".pin-and-cite-journal.json").write_text('{"state": "staging", "files": []}')
    hold = "import sys; from pathlib import Path; from pin_and_cite.core.write_lock import write_lock\n"
    hold += "with write_lock(Path(sys.argv[1])):\n    print('held', flush=True); sys.stdin.read()\n"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(project)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tools")},
    )
    assert holder.stdout.readline() == "held\n"
    build_proc = subprocess.Popen(
        [sys.executable, "-m", "mkdocs", "build", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**mkdocs_env(), "PIN_AND_CITE_PROJECT": str(project)},
        stderr=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([build_proc.stderr], [], [], 120)  # a bound on a hang, not on speed
    line = build_proc.stderr.readline() if ready else "(nothing said in 120 s)"
    while ready and line and not line.startswith("pin-and-cite: waiting"):  # mkdocs' own INFO lines first
        line = build_proc.stderr.readline()
    assert f"held by pid {holder.pid} (-c " in line, line
    assert build_proc.poll() is None
    holder.communicate("")
    _, err = build_proc.communicate(timeout=120)
    assert build_proc.returncode != 0 and "holds an interrupted write" in err, err
    assert not (tmp_path / "site" / "index.html").exists()


def test_a_broken_note_stops_the_build_with_its_file_and_line_and_keeps_the_previous_site(
    vendored_docs, tmp_path, caplog, monkeypatch
):
    """Bad input in a note (Jinja error, unknown citation, over the word limit, a diagram no recording can
    produce): the build stops with one line naming the template's file:line, before mkdocs cleans the site, and
    render writes nothing, so the previous site and rendered pages stay whole."""
    project = tmp_path / "project"  # a scratch copy of what the notes read: templates, traces,
    for part in ("reading_notes", "reference", "tests/reference", "tests/evidence", "tests/tools"):  # code, tests named
        shutil.copytree(ROOT / part, project / part)
    docs = tmp_path / "docs"
    shutil.copytree(vendored_docs, docs, ignore=shutil.ignore_patterns("notes"))
    monkeypatch.setenv("PIN_AND_CITE_PROJECT", str(project))
    site = tmp_path / "site"
    config = lambda: load_config(config_file=str(ROOT / "mkdocs.yml"), docs_dir=str(docs), site_dir=str(site))
    build(config())
    site_before, notes_before = _files(site), _files(docs / "notes")
    assert "notes/synthesis/index.html" in site_before and "megatron-tp-layers.md" in notes_before

    tp_note = project / "reading_notes" / "megatron-tp-layers.md.j2"
    synthesis = project / "reading_notes" / "synthesis.md.j2"
    original = {tp_note: tp_note.read_text(), synthesis: synthesis.read_text()}
    tp_lines = original[tp_note].split("\n")
    cite_line = next(i for i, line in enumerate(tp_lines, 1) if "layers.py#L920-L922" in line)
    breakages = [
        (
            tp_note,
            lambda t: t.replace("## Connect the dots", "## Connect the dots\n{% if %}"),
            f"reading_notes/megatron-tp-layers.md.j2:{tp_lines.index('## Connect the dots') + 2}: ",
        ),
        (
            tp_note,
            lambda t: t.replace("layers.py#L920-L922", "layers.py#L921-L922"),
            f"reading_notes/megatron-tp-layers.md.j2:{cite_line}: megatron-lm:megatron/core/tensor_parallel/"
            "layers.py#L921-L922 is not in the lock",
        ),
        (
            tp_note,
            lambda t: t + "\n" + " ".join(["more"] * 40) + "\n",
            f"reading_notes/megatron-tp-layers.md.j2:{len(tp_lines) + 1}: ",
        ),
        (
            synthesis,
            lambda t: t.replace('diagram("fsdp_forward"', 'diagram("fsdp_backward"'),
            "reading_notes/synthesis.md.j2:",
        ),
    ]
    for template, damage, message in breakages:
        template.write_text(damage(original[template]))
        caplog.clear()
        with pytest.raises(Abort):
            build(config())
        (error,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert message in error and "\n" not in error, error
        assert _files(site) == site_before and _files(docs / "notes") == notes_before
        template.write_text(original[template])
    assert "no recorded trace 'fsdp_backward'" in error


def test_changes_between_pins_page_is_listed_and_says_no_bump_is_recorded(built_site):
    """The shipped lock records no bump (its pins were bootstrapped from the installed wheels), so the change
    pages are only their index, and it says why; it is in every page's navigation."""
    changes = built_site / "notes" / "changes"
    assert sorted(p.name for p in changes.iterdir()) == ["index.html"]
    page = (changes / "index.html").read_text()
    assert '<h1 id="changes-between-pins">Changes between pins' in page and "No bump is recorded in" in page
    assert '<a href="notes/changes/" class="md-nav__link' in (built_site / "index.html").read_text()


def test_no_list_item_falls_out_of_its_list_as_literal_text(built_site):
    """An excerpt or evidence line inside a bullet ended the list, and the next bullet showed as a literal "- " on
    the Scale page (a bullet must follow a blank line after them)."""
    stray = {
        page.relative_to(built_site).as_posix(): line.strip()[:60]
        for page in (built_site / "notes").rglob("index.html")
        for line in page.read_text().split("\n")
        if line.startswith("- ") or "<p>- " in line
    }
    assert stray == {}

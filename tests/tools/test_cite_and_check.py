"""cite and check against a real git daemon: excerpts, symbols, the lock, and where broken citations are."""

import json

from tests.tools.conftest import FREE_FORM

LAYERS = "up:pkg/core/layers.py"


def test_pin_resolves_tag_to_full_sha_and_records_it(project, upstream):
    project.write_pins(up={"url": upstream.url, "commit": upstream.v2})
    r = project.run("pin", "up", "--ref", "v1", "--json")
    assert r.code == 0, r.err
    assert r.json() == {"source": "up", "commit": upstream.v1, "tag": "v1", "previous": upstream.v2}
    assert f'commit = "{upstream.v1}"' in project.pins_path.read_text()
    assert 'tag = "v1"' in project.pins_path.read_text()


def test_pin_accepts_a_full_sha_it_can_fetch(project, upstream):
    r = project.run("pin", "up", "--ref", upstream.v2)
    assert r.code == 0, r.err
    assert f'commit = "{upstream.v2}"' in project.pins_path.read_text()


def test_cite_by_range_prints_numbered_excerpt_and_locks_it(project, upstream):
    r = project.run("cite", f"{LAYERS}#L9-L10")
    assert r.code == 0, r.err
    assert r.out.splitlines()[1] == " 9 | class ColumnParallel:"
    assert r.out.splitlines()[2] == '10 |     """Splits the output dimension."""'
    lock = json.loads(project.lock_path.read_text())
    assert lock["files"][LAYERS]["commit"] == upstream.v1
    assert lock["citations"][f"{LAYERS}#L9-L10"]["lines"] == [9, 10]


def test_cite_by_symbol_includes_stacked_decorators(project):
    r = project.run("cite", f"{LAYERS}::ColumnParallel.forward", "--json")
    assert r.code == 0, r.err
    [excerpt] = r.json()
    assert excerpt["lines"] == [12, 15]
    assert excerpt["text"].startswith("    @staticmethod\n    @traced\n    def forward(ctx, x):")
    assert excerpt["permalink"] is None  # git:// remotes have no web permalink


def test_permalink_is_github_style_for_web_urls(project, upstream):
    project.write_pins(up={"url": "https://github.com/example/up.git", "commit": upstream.v1})
    r = project.run("cite", f"{LAYERS}#L9-L10", "--json", "--url", f"up={upstream.url}")
    assert r.code == 0, r.err
    assert r.json()[0]["permalink"] == f"https://github.com/example/up/blob/{upstream.v1}/pkg/core/layers.py#L9-L10"


def test_check_passes_offline_after_cite(project, upstream, daemon):
    assert project.run("cite", f"{LAYERS}::ColumnParallel", "up:pkg/core/mappings.py#L1-L2").code == 0
    project.write_pins(up={"url": "git://127.0.0.1:9/unreachable", "commit": upstream.v1})  # no network needed
    r = project.run("check", "--json")
    assert r.code == 0, r.out + r.err
    assert r.json() == {"checked": 2, "broken": 0, "problems": []}


def test_check_names_note_file_and_line_of_each_broken_citation(project):
    assert project.run("cite", f"{LAYERS}#L9-L10").code == 0
    note = project.root / "reading_notes" / "layers.md.j2"
    note.write_text(
        FREE_FORM + f"# Layers\n\nThe class:\n{{{{ cite('{LAYERS}#L9-L10') }}}}\n\n{{{{ cite('{LAYERS}#L1-L3') }}}}\n"
    )
    lock = json.loads(project.lock_path.read_text())
    lock["citations"][f"{LAYERS}#L9-L10"]["text_sha256"] = "0" * 64  # the lock claims other text
    project.lock_path.write_text(json.dumps(lock))
    r = project.run("check")
    assert r.code == 1
    assert f"reading_notes/layers.md.j2:7: {LAYERS}#L9-L10: cited text differs from the lock's hash" in r.out
    assert f"reading_notes/layers.md.j2:9: {LAYERS}#L1-L3: not in the lock" in r.out
    assert r.out.rstrip().endswith("0 citation(s) ok, 2 broken")


def test_check_reports_a_moved_pin_as_stale(project, upstream):
    assert project.run("cite", f"{LAYERS}#L9-L10").code == 0
    project.write_pins(up={"url": upstream.url, "commit": upstream.v2})
    r = project.run("check")
    assert r.code == 1
    assert f"locked at {upstream.v1[:12]} but pins.toml now pins {upstream.v2[:12]}" in r.out


def test_pin_refuses_to_orphan_locked_citations(project, upstream):
    assert project.run("cite", f"{LAYERS}#L9-L10").code == 0
    before = project.pins_path.read_text()
    r = project.run("pin", "up", "--ref", upstream.v2)
    assert r.code == 2 and "would orphan their citations" in r.err
    assert project.pins_path.read_text() == before


def test_cli_help_teaches_the_citation_forms():
    import subprocess

    from tests.tools.conftest import CLI

    out = subprocess.run([str(CLI), "--help"], capture_output=True, text=True).stdout
    assert "SOURCE:PATH#Lstart-Lend" in out and "SOURCE:PATH::Qual.name" in out
    for verb in ("pin", "fetch", "cite", "check"):
        assert verb in out


def test_check_counts_no_citation_ok_when_the_only_template_is_broken(project):
    (project.root / "reading_notes" / "broken.md.j2").write_text(FREE_FORM + "# Broken\n\n{{ no_such_helper() }}\n")
    r = project.run("check")
    assert r.code == 1
    assert "reading_notes/broken.md.j2:6" in r.out
    assert r.out.rstrip().endswith("0 citation(s) ok, 1 broken"), r.out

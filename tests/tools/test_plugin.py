"""pins.toml's `[site] plugin` names the module whose helpers and note rules the notes render with: only a module
shipped beside pin_and_cite, never one a checkout brings or any other module on the path, and one that has a
`PLUGIN`; a project naming none renders with the tool's own globals, under no note rules."""

from __future__ import annotations

import pytest

from tests.tools.conftest import FREE_FORM, STUDY_PLUGIN


def _pins_with(project, plugin: str | None) -> None:
    sources = project.pins_path.read_text().replace(STUDY_PLUGIN, "")
    project.pins_path.write_text((f'[site]\nplugin = "{plugin}"\n\n' if plugin is not None else "") + sources)


def test_the_study_plugin_gives_the_notes_its_helpers(project):
    (project.root / "reading_notes" / "a.md.j2").write_text(FREE_FORM + "{{ human(2048) }}\n")
    r = project.run("render")
    assert r.code == 0, r.err
    assert "2.00 KiB" in (project.root / "docs" / "notes" / "a.md").read_text()


def test_without_a_plugin_the_study_helpers_are_unknown_and_no_note_rules_apply(project):
    _pins_with(project, None)
    (project.root / "reading_notes" / "a.md.j2").write_text("# no front matter\n\n{{ human(2048) }}\n")
    r = project.run("check")
    assert r.code == 1 and "reading_notes/a.md.j2:3: render: 'human' is undefined" in r.out, r.out
    assert "rules" not in r.out


@pytest.mark.parametrize(
    ("plugin", "why"),
    [
        ("os", "no such module beside pin_and_cite"),
        ("tests.tools.conftest", "no such module beside pin_and_cite"),
        ("pin_and_cite.core.errors", "the module has no PLUGIN"),
        ("Study", "no such module beside pin_and_cite"),
    ],
)
def test_a_plugin_not_shipped_beside_the_tool_or_without_plugin_is_one_line(project, plugin, why):
    _pins_with(project, plugin)
    r = project.run("check")
    assert r.code == 2 and why in r.err and r.err.count("\n") == 1, (r.code, r.err)

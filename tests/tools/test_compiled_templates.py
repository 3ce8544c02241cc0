"""The compiled-template cache (pin_and_cite.core.compiled_templates) makes a warm `check` skip Jinja's parse
and code generation, and can never change what a run renders: an entry is used only when it names the
template text just read and carries the MAC of this user's key, so a planted, copied or damaged entry is
compiled afresh, and a key anyone else could read or write turns the cache off."""

import json
import os
import shutil

import pytest

from tests.tools.conftest import FREE_FORM

NOTE = FREE_FORM + "# Note\n\n{{ 6 * 7 }}\n"
PLANTED = "raise SystemExit(__import__('os').system('touch {marker}'))\n"


def _entries(project):
    return sorted((project.cache / "compiled").rglob("*.json"))


def _render(project):
    shutil.rmtree(project.cache / "pages", ignore_errors=True)  # a kept page would not load its template at all
    run = project.run("render")
    assert run.code == 0, run.out + run.err
    return (project.root / "docs" / "notes" / "note.md").read_text()


def test_a_warm_run_reads_its_entry_and_says_the_same(project):
    (project.root / "reading_notes" / "note.md.j2").write_text(NOTE)
    cold = _render(project)
    assert "42" in cold
    [entry] = _entries(project)
    assert set(json.loads(entry.read_bytes())) == {"made_from", "text", "mac"}
    assert not list(project.root.rglob("*.json.tmp")) and not (project.root / "compiled").exists()
    assert _render(project) == cold
    assert _entries(project) == [entry]  # read, not written again


@pytest.mark.parametrize("forge", ["no-mac", "other-key", "other-template", "garbage"])
def test_a_planted_entry_changes_nothing(project, tmp_path, forge):
    """An entry whose Python would touch a marker: it is never run, and the page renders as it should."""
    note = project.root / "reading_notes" / "note.md.j2"
    note.write_text(NOTE)
    cold = _render(project)
    [entry] = _entries(project)
    marker = tmp_path / "planted-code-ran"
    stored = json.loads(entry.read_bytes())
    planted = {**stored, "text": PLANTED.format(marker=marker)}
    if forge == "other-key":  # a MAC made with some other key
        import hashlib
        import hmac

        made = (stored["made_from"] + planted["text"]).encode()
        planted["mac"] = hmac.new(b"k" * 32, made, hashlib.sha256).hexdigest()
    if forge == "other-template":  # a genuine entry of another template, moved to this one's name
        note.write_text(NOTE.replace("6 * 7", "6 * 8"))
        assert "48" in _render(project)
        [other] = [e for e in _entries(project) if e != entry]
        planted = json.loads(other.read_bytes())
        note.write_text(NOTE)
    entry.write_bytes(b"\x80{" if forge == "garbage" else json.dumps(planted).encode())
    assert _render(project) == cold
    assert not marker.exists()
    assert json.loads(entry.read_bytes())["mac"] == stored["mac"]  # compiled afresh and written again


def test_a_key_others_can_read_turns_the_cache_off(project):
    (project.root / "reading_notes" / "note.md.j2").write_text(NOTE)
    cold = _render(project)
    key = project.cache / "verified.key"
    for entry in _entries(project):
        entry.unlink()
    os.chmod(key, 0o644)
    assert _render(project) == cold
    assert _entries(project) == []  # nothing kept under a key another user could have read

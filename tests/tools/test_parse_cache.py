"""The parse cache (pin_and_cite.core.parse_cache) and the compiled-template cache (pin_and_cite.core.sandbox)
make a warm `check` fast and can never change its verdict: entries are keyed by content hash, and a damaged
entry is computed again."""

import json

from pin_and_cite.core.gitobj import blob_sha
from pin_and_cite.core.parse_cache import ParseCache
from tests.tools.conftest import FREE_FORM

LAYERS = "up:pkg/core/layers.py"
NOTE = (
    FREE_FORM + "# Layers\n\n{{ cite('" + LAYERS + "::ColumnParallel', highlight='L12-L15') }}\n\n"
    "{{ upstream('" + LAYERS + "::ColumnParallel.backward') }}\n"
)


def test_an_entry_belongs_to_one_blob_and_a_damaged_one_is_computed_again(tmp_path):
    old, new = blob_sha(b"def f():\n    pass\n"), blob_sha(b"x = 1\n\n\ndef f():\n    pass\n")
    assert ParseCache(tmp_path).get(old, "definitions", lambda: {"f": [[1, 2]]}, dict) == {"f": [[1, 2]]}
    cache = ParseCache(tmp_path)  # a new process: from disk
    assert cache.get(old, "definitions", lambda: {"f": [[9, 9]]}, dict) == {"f": [[1, 2]]}
    assert cache.get(new, "definitions", lambda: {"f": [[4, 5]]}, dict) == {"f": [[4, 5]]}  # changed file
    [entry] = [p for p in tmp_path.rglob("*.json") if old[2:] in str(p)]
    for damage in (b"", b'{"what": "defin', b"\xff\x00", json.dumps({"what": "definitions", "value": 7}).encode()):
        entry.write_bytes(damage)
        recomputed = ParseCache(tmp_path).definitions(old, lambda: __import__("ast").parse("def g():\n    pass\n"))
        assert recomputed == {"g": [(1, 2)]}, damage
        assert json.loads(entry.read_bytes())["value"] == {"g": [[1, 2]]}  # and written again


def test_check_says_the_same_from_a_cold_a_warm_and_a_damaged_cache(project):
    assert project.run("cite", f"{LAYERS}::ColumnParallel", f"{LAYERS}::ColumnParallel.backward").code == 0
    (project.root / "reading_notes" / "layers.md.j2").write_text(NOTE)
    cold = project.run("check")
    assert cold.code == 0 and cold.out.endswith("2 citation(s) ok, 0 broken\n"), cold.out + cold.err
    entries = list((project.cache / "parsed").rglob("*.json"))
    assert len(entries) >= 3  # the file's definitions and statements, the note's calls
    assert not (project.cache / "jinja").exists()  # no Jinja bytecode cache: loading one would unpickle it
    assert project.run("check") == cold
    for entry in entries:
        entry.write_bytes(b"\x80garbage")
    assert project.run("check") == cold
    assert all(entry.read_bytes() != b"\x80garbage" for entry in entries)  # rebuilt


def test_a_stale_entry_never_hides_a_broken_highlight(project):
    """A note edited after a warm check is parsed again: its new, broken highlight is reported."""
    assert project.run("cite", f"{LAYERS}::ColumnParallel", f"{LAYERS}::ColumnParallel.backward").code == 0
    note = project.root / "reading_notes" / "layers.md.j2"
    note.write_text(NOTE)
    assert project.run("check").code == 0
    note.write_text(NOTE.replace("L12-L15", "L12-L14"))
    r = project.run("check")
    assert r.code == 1 and "highlight L12-L14 must end on a statement's last line" in r.out, r.out

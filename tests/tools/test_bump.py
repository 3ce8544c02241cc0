"""`bump` end to end: templates rewritten byte for byte except the line numbers, pins and lock moved, a review
report, --dry-run and failures writing nothing."""

import json
import os

import git
import pytest

from tests.tools.conftest import serve_history
from tests.tools.synthetic import BASE

MOD = "up:pkg/mod.py"
FREE_FORM = "---\r\nrules: none\r\n---\r\n"  # the page keeps no structure rules (note_rules)
TEMPLATE = (
    FREE_FORM + "{# cite('" + MOD + "#L12-L14') in a comment is not a call #}\r\n"
    "# Layers\r\n"
    "\r\n"
    "The constructor {{ cite('" + MOD + "#L12-L14') }} and, quoted twice,\r\n"
    '{{ cite("' + MOD + '#L17-L19") }}. Prose naming ' + MOD + "#L12-L14 stays as it is.\r\n"
    "{{ cite('" + MOD + "::Column.backward') }}{{ cite('" + MOD + "#L12-L14') }}\r\n"
    "{{ cite('up:docs/notes.txt#L2') }} {{ cite('" + MOD + "::helper') }} {{ cite('" + MOD + "#L25-L28') }}\r\n"
)
AFTER = (
    FREE_FORM + "{# cite('" + MOD + "#L12-L14') in a comment is not a call #}\r\n"
    "# Layers\r\n"
    "\r\n"
    "The constructor {{ cite('" + MOD + "#L15-L17') }} and, quoted twice,\r\n"
    '{{ cite("' + MOD + '#L20-L22") }}. Prose naming ' + MOD + "#L12-L14 stays as it is.\r\n"
    "{{ cite('" + MOD + "::Column.backward') }}{{ cite('" + MOD + "#L15-L17') }}\r\n"
    "{{ cite('up:docs/notes.txt#L2') }} {{ cite('" + MOD + "::helper') }} {{ cite('" + MOD + "#L28-L31') }}\r\n"
)


@pytest.fixture
def noted(project, history):
    """A project pinned at c1 whose note cites the history, every citation locked."""
    project.write_pins(up={"url": history.url, "commit": history.c1, "tag": "c1"})
    note = project.root / "reading_notes" / "layers.md.j2"
    note.write_bytes(TEMPLATE.encode())
    specs = [
        f"{MOD}#L12-L14",
        f"{MOD}#L17-L19",
        f"{MOD}::Column.backward",
        "up:docs/notes.txt#L2",
        f"{MOD}::helper",
        f"{MOD}#L25-L28",
    ]
    r = project.run("cite", *specs, "--json")
    assert r.code == 0, r.err
    assert project.run("check").code == 0
    return note


def snapshot(project) -> dict:
    return {p: p.read_bytes() for p in (project.root / "reading_notes").rglob("*") if p.is_file()}


def test_bump_rewrites_only_the_line_numbers_and_moves_pin_and_lock(project, history, noted):
    r = project.run("bump", "up", "--ref", "c2", "--json")
    assert r.code == 0, r.err
    assert noted.read_bytes() == AFTER.encode()
    pins = project.pins_path.read_text()
    assert f'commit = "{history.c2}"' in pins and 'tag = "c2"' in pins
    report = r.json()
    assert report["counts"] == {"unchanged": 1, "moved": 2, "changed": 3, "deleted": 0}
    assert {c["cite"]: (c["status"], c["lines"], c["new_cite"]) for c in report["citations"]} == {
        f"{MOD}#L12-L14": ("moved", [15, 17], f"{MOD}#L15-L17"),
        f"{MOD}#L17-L19": ("changed", [20, 22], f"{MOD}#L20-L22"),
        f"{MOD}::Column.backward": ("moved", [24, 25], f"{MOD}::Column.backward"),
        "up:docs/notes.txt#L2-L2": ("unchanged", [2, 2], "up:docs/notes.txt#L2-L2"),
        f"{MOD}::helper": ("changed", [28, 31], None),  # renamed: a person must edit the note
        f"{MOD}#L25-L28": ("changed", [28, 31], f"{MOD}#L28-L31"),
    }
    lock = json.loads(project.lock_path.read_text())
    assert {f["commit"] for f in lock["files"].values()} == {history.c2}
    assert sorted(lock["citations"]) == sorted(c["new_cite"] for c in report["citations"] if c["new_cite"])
    assert lock["citations"][f"{MOD}::Column.backward"]["lines"] == [24, 25]
    r = project.run("check")  # only the renamed symbol needs a person now
    assert r.code == 1
    assert (
        r.out.splitlines()[0]
        == f"reading_notes/layers.md.j2:10: {MOD}::helper: the bump to c2 found no code under this name (its "
        "closest match is L28-L31): rewrite the claim"
    )
    assert r.out.rstrip().endswith("5 citation(s) ok, 1 broken")


def test_review_report_shows_where_and_the_old_and_new_excerpts(project, history, noted):
    r = project.run("bump", "up", "--ref", "c2", "--dry-run", "--diff")
    assert r.code == 0, r.err
    out = r.out
    assert out.splitlines()[0] == f"up: {history.c1[:12]} -> {history.c2[:12]} (c2)  [dry run: nothing written]"
    assert out.splitlines()[1] == "6 citation(s): 1 unchanged, 2 moved, 3 changed, 0 deleted"
    block = out[out.index(f"changed: {MOD}#L17-L19") :].split("\n\n")[0].splitlines()
    assert block == [
        f"changed: {MOD}#L17-L19 -> {MOD}#L20-L22",
        "  cited at reading_notes/layers.md.j2:8",
        f"  --- pkg/mod.py#L17-L19 @ {history.c1[:12]}",
        f"  +++ pkg/mod.py#L20-L22 @ {history.c2[:12]}",
        "  @@ -17,3 +20,3 @@",
        "           y = x * 2",
        "  -        y = y + 1",
        "  +        y = y + 2",
        "           return y",
    ]
    assert f"changed: {MOD}::helper -> left as written: fix the note (`check` fails until then)" in out
    assert "  note: helper is gone; combine looks like it renamed" in out
    assert "  -def helper(a, b):\n  +def combine(a, b):" in out
    assert "\nmoved: " not in out and "\nunchanged: " not in out  # moved/unchanged have no diff to review


def test_report_opens_with_one_line_per_citation_and_shows_diffs_only_with_diff(project, history, noted):
    r = project.run("bump", "up", "--ref", "c2", "--dry-run")
    assert r.code == 0, r.err
    assert r.out.split("\n\n")[1].splitlines() == [
        f"changed   {MOD}#L17-L19 -> L20-L22  reading_notes/layers.md.j2:8",
        f"changed   {MOD}#L25-L28 -> L28-L31  reading_notes/layers.md.j2:10",
        f"changed   {MOD}::helper (L25-L28) -> L28-L31, left as written  reading_notes/layers.md.j2:10",
        f"moved     {MOD}#L12-L14 -> L15-L17  reading_notes/layers.md.j2:7,9",
        f"moved     {MOD}::Column.backward (L21-L22) -> L24-L25  reading_notes/layers.md.j2:9",
        "unchanged up:docs/notes.txt#L2-L2 -> L2-L2  reading_notes/layers.md.j2:10",
    ]
    hint = "old vs new excerpts of the changed and deleted: add --diff"
    assert "@@" not in r.out and r.out.split("\n\n")[0].splitlines()[-1] == hint
    with_diff = project.run("bump", "up", "--ref", "c2", "--dry-run", "--diff").out
    assert with_diff.startswith(r.out.replace(hint + "\n", ""))
    assert with_diff.count("@@ -") == 3


def test_dry_run_writes_nothing(project, noted):
    before = snapshot(project)
    r = project.run("bump", "up", "--ref", "c2", "--dry-run", "--json")
    assert r.code == 0, r.err
    assert r.json()["dry_run"] is True and r.json()["written"] == []
    assert snapshot(project) == before


def test_unknown_ref_writes_nothing(project, noted):
    before = snapshot(project)
    r = project.run("bump", "up", "--ref", "c9")
    assert r.code == 2 and "has no tag or branch named 'c9'" in r.err
    assert snapshot(project) == before


def test_deleted_code_is_left_as_written_reported_and_unlocked(project, history):
    project.write_pins(up={"url": history.url, "commit": history.c1})
    note = project.root / "reading_notes" / "gone.md.j2"
    note.write_text(FREE_FORM + "Was: {{ cite('up:pkg/mod.py#L31-L32') }}\n")
    assert project.run("cite", "up:pkg/mod.py#L31-L32").code == 0
    r = project.run("bump", "up", "--ref", history.c2, "--diff")
    assert r.code == 0, r.err
    assert note.read_bytes().decode() == FREE_FORM + "Was: {{ cite('up:pkg/mod.py#L31-L32') }}\n"
    assert r.out.splitlines()[1] == "1 citation(s): 0 unchanged, 0 moved, 0 changed, 1 deleted"
    assert r.out.split("\n\n")[2].splitlines() == [
        "deleted: up:pkg/mod.py#L31-L32 -> left as written: fix the note (`check` fails until then)",
        "  cited at reading_notes/gone.md.j2:4",
        f"  --- pkg/mod.py#L31-L32 @ {history.c1[:12]}",
        f"  +++ pkg/mod.py (no counterpart) @ {history.c2[:12]}",
        "  @@ -31,2 +0,0 @@",
        "  -def other(a):",
        "  -    return a",
    ]
    assert json.loads(project.lock_path.read_text())["citations"] == {}
    assert project.run("check").code == 1


def test_pin_points_to_bump_when_citations_would_be_orphaned(project, noted):
    r = project.run("pin", "up", "--ref", "c2")
    assert r.code == 2
    assert "would orphan their citations: use `pin-and-cite bump up --ref c2` to carry them along" in r.err


def test_an_upstream_link_moves_with_its_lines_as_cite_does(project, history):
    """upstream() links to the same lines as cite() shows them: a bump rewrites both (#34: six links kept their
    old numbers after a real bump, and check then advised locking what was at those numbers now)."""
    project.write_pins(up={"url": history.url, "commit": history.c1})
    note = project.root / "reading_notes" / "links.md.j2"
    note.write_bytes(
        (FREE_FORM + "See {{ upstream('" + MOD + "#L12-L14') }} and {{ cite('" + MOD + "#L17-L19') }}.\n").encode()
    )
    assert project.run("cite", f"{MOD}#L12-L14", f"{MOD}#L17-L19").code == 0
    r = project.run("bump", "up", "--ref", "c2")
    assert r.code == 0, r.err
    assert (
        note.read_bytes().decode()
        == FREE_FORM + "See {{ upstream('" + MOD + "#L15-L17') }} and {{ cite('" + MOD + "#L20-L22') }}.\n"
    )
    assert f"moved     {MOD}#L12-L14 -> L15-L17  reading_notes/links.md.j2:4" in r.out.splitlines()
    assert project.run("check").code == 0


def test_citations_only_in_the_lock_are_carried_too(project, history):
    project.write_pins(up={"url": history.url, "commit": history.c1})
    assert project.run("cite", f"{MOD}#L12-L14", f"{MOD}#L17-L19").code == 0
    r = project.run("bump", "up", "--ref", "c2")
    assert r.code == 0, r.err
    assert sorted(json.loads(project.lock_path.read_text())["citations"]) == [f"{MOD}#L15-L17", f"{MOD}#L20-L22"]
    assert f"changed   {MOD}#L17-L19 -> L20-L22  citations.lock" in r.out.splitlines()
    assert project.run("check").code == 0


def test_bump_carries_docstring_citations_and_check_names_one_whose_symbol_was_renamed(project, history):
    """A symbol citation in the reference names no line: bump re-locks it where the code went and leaves the
    docstring as written; a renamed symbol is listed where it is cited, and `check` names the docstring."""
    project.write_pins(up={"url": history.url, "commit": history.c1, "tag": "c1"})
    (project.root / "reference").mkdir()
    ours = project.root / "reference" / "mod.py"
    ours.write_text(
        f'def backward():\n    """Mirrors `{MOD}::Column.backward`."""\n\n\n'
        f'def helper():\n    """Mirrors `{MOD}::helper`."""\n'
    )
    assert project.run("cite", f"{MOD}::Column.backward", f"{MOD}::helper").code == 0
    assert project.run("check").code == 0
    before = ours.read_bytes()
    r = project.run("bump", "up", "--ref", "c2", "--json")
    assert r.code == 0, r.err
    assert ours.read_bytes() == before
    assert {c["cite"]: (c["new_cite"], c["where"]) for c in r.json()["citations"]} == {
        f"{MOD}::Column.backward": (f"{MOD}::Column.backward", ["reference/mod.py:2"]),
        f"{MOD}::helper": (None, ["reference/mod.py:6"]),
    }
    assert json.loads(project.lock_path.read_text())["citations"][f"{MOD}::Column.backward"]["lines"] == [24, 25]
    r = project.run("check")
    assert r.code == 1
    assert r.out.splitlines() == [
        f"reference/mod.py:6: {MOD}::helper: the bump to c2 found no code under this name (its closest match is "
        "L28-L31): rewrite the claim",
        "1 citation(s) ok, 1 broken",
    ]


@pytest.fixture
def deleted(project, daemon, tmp_path):
    """A note citing `other` (pkg/mod.py#L31-L32), bumped c1 -> c2, where `other` is deleted and lines 31-32 hold
    unrelated code: re-locking the same span would put that code under the prose about `other`."""
    gone = BASE.replace("def other(a):\n    return a\n", "NAMES = ('x', 'y')\nSIZES = {}\n")
    history = serve_history(
        daemon,
        tmp_path / "work",
        f"deleted-{tmp_path.name}",
        [{"pkg/mod.py": BASE.encode()}, {"pkg/mod.py": gone.encode()}],
    )
    project.write_pins(up={"url": history.url, "commit": history.c1, "tag": "c1"})
    note = project.root / "reading_notes" / "gone.md.j2"
    note.write_text(FREE_FORM + "`other` returns its argument: {{ cite('up:pkg/mod.py#L31-L32') }}\n")
    assert project.run("cite", "up:pkg/mod.py#L31-L32").code == 0
    r = project.run("bump", "up", "--ref", "c2")
    assert r.code == 0, r.err
    assert r.out.splitlines()[1] == "1 citation(s): 0 unchanged, 0 moved, 0 changed, 1 deleted"
    return note


def test_check_names_a_citation_the_bump_deleted_and_says_to_rewrite_the_claim(project, deleted):
    r = project.run("check")
    assert r.code == 1
    assert r.out.splitlines()[0] == (
        "reading_notes/gone.md.j2:4: up:pkg/mod.py#L31-L32: deleted by the bump to c2: rewrite the claim, then cite"
    )


def test_cite_refuses_to_relock_a_span_the_last_bump_deleted_until_told_the_claim_was_rewritten(project, deleted):
    before = project.lock_path.read_bytes()
    r = project.run("cite", "up:pkg/mod.py#L31-L32")
    assert r.code == 2 and r.err.count("\n") == 1
    assert r.err == (
        "pin-and-cite: error: up:pkg/mod.py#L31-L32: the bump to c2 deleted the code it cited, so the prose "
        "around it describes code that is gone: rewrite the claim, then `cite --rewritten` it\n"
    )
    assert project.lock_path.read_bytes() == before
    assert project.run("cite", "--no-lock", "up:pkg/mod.py#L31-L32").code == 0  # reading is still allowed
    deleted.write_text(FREE_FORM + "The lines that followed it: {{ cite('up:pkg/mod.py#L31-L32') }}\n")
    assert project.run("cite", "--rewritten", "up:pkg/mod.py#L31-L32").code == 0
    assert project.run("check").code == 0


def package_index(monkeypatch, folder, *releases: str) -> None:
    """From now on pip (which `bump` asks whether a wheel's release exists) sees only `releases` (NAME==VERSION),
    as empty wheel files in `folder`: no network, no other index."""
    folder.mkdir(exist_ok=True)
    for release in releases:
        name, version = release.split("==")
        (folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))


@pytest.fixture
def released(project, daemon, tmp_path, monkeypatch):
    """A source whose release tags name its wheel's version (core_v0.1.0 -> synthetic-core==0.1.0), pinned at
    core_v0.1.0 with constraints.txt pinning that wheel, one citation locked; c2 is also tagged core_v0.2.0."""
    moved = "# header\n" + BASE
    history = serve_history(
        daemon,
        tmp_path / "work",
        f"released-{tmp_path.name}",
        [{"pkg/mod.py": BASE.encode()}, {"pkg/mod.py": moved.encode()}],
    )
    served = git.Repo(daemon.base / f"released-{tmp_path.name}.git")
    served.create_tag("core_v0.1.0", ref=history.c1)
    served.create_tag("core_v0.2.0", ref=history.c2)
    package_index(monkeypatch, tmp_path / "index", "synthetic-core==0.1.0", "synthetic-core==0.2.0")
    project.write_pins(
        up={"url": history.url, "commit": history.c1, "tag": "core_v0.1.0", "distribution": "synthetic-core==0.1.0"}
    )
    (project.root / "constraints.txt").write_text("numpy==2.0\nsynthetic-core==0.1.0\ntorch==2.13.0\n")
    assert project.run("cite", f"{MOD}#L12-L14").code == 0
    assert project.run("check").code == 0
    return history


def test_bump_to_a_release_tag_moves_the_distribution_and_the_constraint_with_it(project, released):
    r = project.run("bump", "up", "--ref", "core_v0.2.0")
    assert r.code == 0, r.err
    assert "distribution: synthetic-core==0.1.0 -> synthetic-core==0.2.0" in r.out.splitlines()
    assert 'distribution = "synthetic-core==0.2.0"' in project.pins_path.read_text()
    assert (project.root / "constraints.txt").read_text() == "numpy==2.0\nsynthetic-core==0.2.0\ntorch==2.13.0\n"
    assert project.run("check").code == 0


def test_a_bump_no_release_matches_leaves_the_distribution_and_check_says_the_tests_run_another_version(
    project, released
):
    r = project.run("bump", "up", "--ref", "c2")
    assert r.code == 0, r.err
    assert (
        "distribution: synthetic-core==0.1.0 left as it was: c2 names no release; `check` fails until "
        "bump --distribution names the one of the new pin" in r.out.splitlines()
    )
    assert (project.root / "constraints.txt").read_text() == "numpy==2.0\nsynthetic-core==0.1.0\ntorch==2.13.0\n"
    r = project.run("check")
    assert r.code == 1
    assert r.out.splitlines()[0] == (
        "reading_notes/pins.toml: up: the upstream tests run synthetic-core==0.1.0 but the notes cite "
        f"{released.c2[:12]} (c2), which is not that release; bump with --distribution NAME==VERSION "
        "(or none)"
    )


def test_bump_distribution_names_the_release_of_a_pin_no_rule_can_map(project, released):
    r = project.run("bump", "up", "--ref", released.c2, "--distribution", "synthetic-core==0.2.0")
    assert r.code == 0, r.err
    assert (project.root / "constraints.txt").read_text() == "numpy==2.0\nsynthetic-core==0.2.0\ntorch==2.13.0\n"
    assert project.run("check").code == 0


def test_check_fails_when_constraints_pin_another_version_than_the_cited_release(project, released):
    (project.root / "constraints.txt").write_text("synthetic-core==0.3.0\n")
    r = project.run("check")
    assert r.code == 1
    assert r.out.splitlines()[0] == (
        "constraints.txt: up: the upstream tests run synthetic-core==0.3.0 but the notes cite "
        "synthetic-core==0.1.0 (pins.toml); make them agree"
    )


def test_a_bump_to_a_release_the_package_index_lacks_is_refused_at_once_and_keeps_the_pin(
    project, released, tmp_path, monkeypatch
):
    """#34: a bump to core_v0.19.0 asked constraints.txt for megatron-core==0.19.0, which this machine's index
    does not have."""
    package_index(monkeypatch, tmp_path / "older", "synthetic-core==0.1.0")
    before = snapshot(project)
    r = project.run("bump", "up", "--ref", "core_v0.2.0")
    assert r.code == 2 and r.err.count("\n") == 1
    assert r.err == (
        "pin-and-cite: error: synthetic-core==0.2.0 is not on the package index pip uses here (`pip index versions "
        f"synthetic-core`), so the upstream tests could not run it: the pin stays at {released.c1[:12]}; name a "
        "release it has with --distribution NAME==VERSION, or --distribution none\n"
    )
    assert snapshot(project) == before
    assert project.run("bump", "up", "--ref", "core_v0.2.0", "--distribution", "none").code == 0


def test_check_fails_when_a_bump_moved_the_wheel_and_the_environment_kept_the_old_one(
    project, daemon, tmp_path, monkeypatch
):
    """A bump to a release the package index lacks leaves the old wheel installed: the upstream tests would run
    it, not the release the notes cite (#34: .venv kept megatron-core 0.16.1 after a bump to 0.19.0). Without a
    bump of the wheel, an installed version is the user's own choice, never a problem."""
    from importlib.metadata import version

    installed = version("fastjsonschema")  # installed with the tool: stands in for the source's wheel
    history = serve_history(
        daemon, tmp_path / "work", "wheel", [{"pkg/mod.py": BASE.encode()}, {"pkg/mod.py": ("# x\n" + BASE).encode()}]
    )
    served = git.Repo(daemon.base / "wheel.git")
    served.create_tag("core_v9.9.9", ref=history.c2)
    package_index(monkeypatch, tmp_path / "index", "fastjsonschema==9.9.9")
    project.write_pins(up={"url": history.url, "commit": history.c1, "distribution": "fastjsonschema==0.0.1"})
    assert project.run("cite", f"{MOD}#L12-L14").code == 0
    assert "this environment" not in project.run("check").out  # no bump moved it: the user's own version
    assert project.run("bump", "up", "--ref", "core_v9.9.9").code == 0
    r = project.run("check")
    assert r.code == 1
    assert (
        "constraints.txt: up: the bump to core_v9.9.9 pins fastjsonschema==9.9.9, but this environment still has "
        f"fastjsonschema=={installed}, so the upstream tests run another release than the notes cite" in r.out
    ), r.out

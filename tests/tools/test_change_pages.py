"""The site's change pages: `bump` records, in the lock, each cited region whose text changed or was deleted
(hashes, lines, blobs, statuses: never upstream text); `fetch` gets the old blobs the record names; `check`
verifies the record; render writes one page per recorded region with its numbered diff, and an index."""

import hashlib
import json
import shutil

import git
import pytest

from pin_and_cite.core.gitobj import blob_sha
from pin_and_cite.site.changes import page_name
from tests.tools.conftest import FREE_FORM, ProjectDir, _write
from tests.tools.synthetic import BASE, HEADER, edited

MOD = "up:pkg/mod.py"
KEEP = "pkg/keep.py"
# At A, in BASE: traced 5-6, Column.__init__ 12-14, forward's body 17-19, helper 25-28, other 31-32.
NOTE = (
    FREE_FORM + "# Layers\n\n{{ cite('" + MOD + "#L5-L6') }}\n{{ cite('" + MOD + "#L12-L14') }}\n"
    "{{ cite('" + MOD + "#L17-L19') }}\n{{ cite('" + MOD + "::helper') }}\n"
    "{{ cite('up:" + KEEP + "#L1-L2') }}\n{{ cite('" + MOD + "#L31-L32') }}\n"
)
OTHER_NOTE = FREE_FORM + "# Also\n\n{{ cite('" + MOD + "#L17-L19') }}\n"
WEB = "https://example.com/up"  # the pinned url, for permalinks; every fetch goes to the daemon (--url)


@pytest.fixture(scope="module")
def abc(daemon, tmp_path_factory):
    """A -> B: a 3-line header moves everything in pkg/mod.py, forward's body is edited, `other` is deleted,
    pkg/keep.py stays. B -> C: helper's body is edited."""
    work = git.Repo.init(tmp_path_factory.mktemp("changes-work"))
    actor = git.Actor("Upstream", "upstream@example.com")
    texts = {"A": BASE, "B": HEADER + edited(("y = y + 1", "y = y + 2"), ("\n\n\ndef other(a):\n    return a\n", "\n"))}
    texts["C"] = texts["B"].replace("total = total * 2", "total = total * 3")
    commits = {}
    for name, text in texts.items():
        _write(work, {"pkg/mod.py": text.encode(), KEEP: b"KEEP_ONE = 1\nKEEP_TWO = 2\n"})
        commits[name] = work.index.commit(name, author=actor, committer=actor).hexsha
        work.create_tag(name)
    work.clone(daemon.base / "changes.git", bare=True)
    return daemon.url("changes.git"), commits, texts


@pytest.fixture
def bumped(tmp_path, abc):
    """A project whose notes cite pkg/mod.py at A, bumped to B, and then the deleted citation taken out of the
    note by a person (until then `check` and the site build fail on it)."""
    url, commits, _ = abc
    project = ProjectDir(tmp_path / "project", tmp_path / "cache")
    project.write_pins(up={"url": WEB + ".git", "commit": commits["A"], "tag": "A"})
    notes = project.root / "reading_notes"
    (notes / "layers.md.j2").write_text(NOTE)
    (notes / "more").mkdir()
    (notes / "more" / "also.md.j2").write_text(OTHER_NOTE)
    assert (
        project.run(
            "cite",
            f"{MOD}#L5-L6",
            f"{MOD}#L12-L14",
            f"{MOD}#L17-L19",
            f"{MOD}::helper",
            f"up:{KEEP}#L1-L2",
            f"{MOD}#L31-L32",
            "--url",
            f"up={url}",
        ).code
        == 0
    )
    r = project.run("bump", "up", "--ref", "B", "--json", "--url", f"up={url}")
    assert r.code == 0, r.err
    assert r.json()["counts"] == {"unchanged": 1, "moved": 3, "changed": 1, "deleted": 1}
    note = notes / "layers.md.j2"
    note.write_text(note.read_text().replace("{{ cite('" + MOD + "#L31-L32') }}\n", ""))
    return project


def pages(project) -> dict[str, str]:
    folder = project.root / "docs" / "notes" / "changes"
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_bump_records_changed_and_deleted_regions_by_hash_lines_and_blob_only(bumped, abc):
    _, commits, texts = abc
    lock = json.loads(bumped.lock_path.read_text())
    record = lock["bumps"]["up"]
    assert record["old_commit"] == commits["A"] and record["new_commit"] == commits["B"] and record["tag"] == "B"
    assert record["counts"] == {"unchanged": 1, "moved": 3, "changed": 1, "deleted": 1}
    assert record["files"] == {"pkg/mod.py": {"old_blob": _blob(texts["A"]), "new_blob": _blob(texts["B"])}}
    changes = record["changes"]
    assert sorted(changes) == [f"{MOD}#L17-L19", f"{MOD}#L31-L32"]
    changed = changes[f"{MOD}#L17-L19"]
    assert (changed["status"], changed["old_lines"], changed["new_lines"], changed["new_cite"]) == (
        "changed",
        [17, 19],
        [20, 22],
        f"{MOD}#L20-L22",
    )
    assert changed["cited_at"] == ["reading_notes/layers.md.j2:8", "reading_notes/more/also.md.j2:6"]
    assert changed["old_text_sha256"] == _sha256(BASE.split("\n")[16:19])
    deleted = changes[f"{MOD}#L31-L32"]
    assert (
        deleted["status"],
        deleted["old_lines"],
        deleted["new_lines"],
        deleted["new_text_sha256"],
        deleted["new_cite"],
        deleted["cited_at"],
    ) == ("deleted", [31, 32], None, None, None, ["reading_notes/layers.md.j2:11"])
    committed = "".join(p.read_text() for p in (bumped.root / "reading_notes").rglob("*") if p.is_file())
    upstream_lines = {line.strip() for text in texts.values() for line in text.split("\n") if len(line.strip()) > 5}
    assert len(upstream_lines) > 15
    assert [line for line in upstream_lines if line in committed] == []


def _blob(text: str) -> str:
    return blob_sha(text.encode())


def _sha256(lines: list[str]) -> str:
    return hashlib.sha256(("\n".join(lines) + "\n").encode()).hexdigest()


CHANGED_PAGE = page_name(f"{MOD}#L17-L19")
DELETED_PAGE = page_name(f"{MOD}#L31-L32")


def test_render_writes_a_page_per_changed_or_deleted_region_and_an_index(bumped, abc):
    _, commits, _ = abc
    a, b = commits["A"][:12], commits["B"][:12]
    r = bumped.run("render")
    assert r.code == 0, r.err
    found = pages(bumped)
    assert sorted(found) == sorted(["index.md", CHANGED_PAGE, DELETED_PAGE])
    changed = found[CHANGED_PAGE]
    assert changed.startswith("# changed: pkg/mod.py L17–L19\n")
    assert (
        "- **Cited by:** [`reading_notes/layers.md.j2:8`](../layers.md), "
        "[`reading_notes/more/also.md.j2:6`](../more/also.md)\n"
    ) in changed
    assert (
        f"- **Old pin:** [L17–L19 @ `{a}`]({WEB}/blob/{commits['A']}/pkg/mod.py#L17-L19)\n"
        f"- **New pin:** [L20–L22 @ `{b}`]({WEB}/blob/{commits['B']}/pkg/mod.py#L20-L22) (`B`)\n"
    ) in changed
    assert f"The notes now cite `{MOD}#L20-L22`" in changed
    assert changed.endswith(
        "```diff\n"
        + "\n".join(
            [
                f"--- pkg/mod.py#L17-L19 @ {a}",
                f"+++ pkg/mod.py#L20-L22 @ {b}",
                "@@ -17,3 +20,3 @@",
                " 17 20 |         y = x * 2",
                "-18    |         y = y + 1",
                "+   21 |         y = y + 2",
                " 19 22 |         return y",
            ]
        )
        + "\n```\n"
    )
    deleted = found[DELETED_PAGE]
    assert deleted.startswith("# deleted: pkg/mod.py L31–L32\n")
    assert "- **Cited by:** [`reading_notes/layers.md.j2:11`](../layers.md)\n" in deleted
    assert f"- **New pin:** no counterpart @ `{b}` (`B`)\n" in deleted
    assert deleted.endswith(
        "```diff\n"
        + "\n".join(
            [
                f"--- pkg/mod.py#L31-L32 @ {a}",
                f"+++ pkg/mod.py (no counterpart) @ {b}",
                "@@ -31,2 +0,0 @@",
                "-31    | def other(a):",
                "-32    |     return a",
            ]
        )
        + "\n```\n"
    )
    index = found["index.md"]
    assert index.startswith("# Changes between pins\n")
    assert f"## up: `{a}` → `{b}` (B)\n\n6 citation(s): 1 unchanged, 3 moved, 1 changed, 1 deleted.\n" in index
    rows = [line for line in index.splitlines() if line.startswith("| [")]
    assert rows == [
        f"| [`{MOD}#L17-L19`]({CHANGED_PAGE}) | changed | "
        "`reading_notes/layers.md.j2:8`, `reading_notes/more/also.md.j2:6` |",
        f"| [`{MOD}#L31-L32`]({DELETED_PAGE}) | deleted | `reading_notes/layers.md.j2:11` |",
    ]
    assert bumped.run("render", "--json").json() == {"changed": []}  # unchanged pages are not rewritten


def test_a_fresh_cache_fetches_the_old_blobs_by_sha_then_renders_and_checks_offline(bumped, abc, tmp_path):
    url, _, texts = abc
    before = bumped.run("render")
    assert before.code == 0, before.err
    fresh = ProjectDir(tmp_path / "clone", tmp_path / "empty-cache")  # what a new user's checkout holds
    shutil.copytree(bumped.root / "reading_notes", fresh.root / "reading_notes", dirs_exist_ok=True)
    r = fresh.run("fetch", "--json", "--url", f"up={url}")
    assert r.code == 0, r.err
    assert {(f["path"], f["blob"], f["origin"]) for f in r.json()} >= {("pkg/mod.py", _blob(texts["A"]), url)}
    assert fresh.run("render").code == 0
    assert pages(fresh) == pages(bumped)
    assert fresh.run("check").code == 0


def test_check_and_render_refuse_a_record_that_does_not_hold(bumped):
    lock = json.loads(bumped.lock_path.read_text())
    lock["bumps"]["up"]["changes"][f"{MOD}#L17-L19"]["old_lines"] = [16, 18]
    bumped.lock_path.write_text(json.dumps(lock))
    why = "bump record of up: the text at L16-L18 of pkg/mod.py at "
    check = bumped.run("check")
    assert check.code == 1
    assert [line for line in check.out.splitlines() if "bump record" in line] == [
        f"citations.lock: {MOD}#L17-L19: {why}{lock['bumps']['up']['old_commit'][:12]} differs from the record's hash"
    ]
    r = bumped.run("render")
    assert r.code == 2 and r.err.count("\n") == 1
    assert f"reading_notes/citations.lock: {MOD}#L17-L19: {why}" in r.err
    lock["bumps"]["up"]["old_commit"] = "abc"
    bumped.lock_path.write_text(json.dumps(lock))
    r = bumped.run("check")
    assert r.code == 2 and "bumps.up.old_commit 'abc' is not a full 40-hex SHA; restore it from git" in r.err
    del lock["bumps"]["up"]["changes"][f"{MOD}#L17-L19"]["cited_at"]
    bumped.lock_path.write_text(json.dumps(lock))
    r = bumped.run("check")
    assert r.code == 2 and "citations.lock is not a valid lock" in r.err


def test_a_second_bump_replaces_the_record_and_removes_stale_pages(bumped, abc):
    url, commits, _ = abc
    assert bumped.run("render").code == 0
    r = bumped.run("bump", "up", "--ref", "C", "--json", "--url", f"up={url}")
    assert r.code == 0, r.err
    record = json.loads(bumped.lock_path.read_text())["bumps"]["up"]
    assert (record["old_commit"], record["new_commit"]) == (commits["B"], commits["C"])
    assert sorted(record["changes"]) == [f"{MOD}::helper"]
    assert record["changes"][f"{MOD}::helper"]["new_cite"] == f"{MOD}::helper"
    r = bumped.run("render", "--json")
    assert r.code == 0, r.err
    gone = {f"docs/notes/changes/{CHANGED_PAGE}", f"docs/notes/changes/{DELETED_PAGE}"}
    assert gone <= set(r.json()["changed"])
    helper = page_name(f"{MOD}::helper")
    assert sorted(pages(bumped)) == sorted(["index.md", helper])
    page = pages(bumped)[helper]
    assert page.startswith("# changed: pkg/mod.py L28–L31 (helper)\n")
    assert "-30    |     total = total * 2\n+   30 |     total = total * 3\n" in page
    assert f"## up: `{commits['B'][:12]}` → `{commits['C'][:12]}` (C)" in pages(bumped)["index.md"]


def test_without_a_bump_the_index_says_none_is_recorded(project):
    assert project.run("render").code == 0
    assert pages(project) == {"index.md": pages(project)["index.md"]}
    assert pages(project)["index.md"].startswith("# Changes between pins\n\nNo bump is recorded in ")


def test_render_writes_the_change_pages_while_a_bump_left_a_note_broken_and_refuses_only_that_note(tmp_path, abc):
    """Before a person fixes the deleted citation: render exits 2 naming it, keeps the note's previous page,
    and writes the change pages (the review the fix needs) and the notes that do render."""
    url, commits, _ = abc
    project = ProjectDir(tmp_path / "project", tmp_path / "cache")
    project.write_pins(up={"url": WEB + ".git", "commit": commits["A"], "tag": "A"})
    notes = project.root / "reading_notes"
    (notes / "layers.md.j2").write_text(NOTE)
    (notes / "also.md.j2").write_text(OTHER_NOTE)
    specs = [f"{MOD}#L5-L6", f"{MOD}#L12-L14", f"{MOD}#L17-L19", f"{MOD}::helper", f"up:{KEEP}#L1-L2", f"{MOD}#L31-L32"]
    assert project.run("cite", *specs, "--url", f"up={url}").code == 0
    assert project.run("render").code == 0
    out = project.root / "docs" / "notes"
    before = (out / "layers.md").read_text()
    assert project.run("bump", "up", "--ref", "B", "--url", f"up={url}").code == 0
    r = project.run("render")
    assert r.code == 2 and r.err.count("\n") == 1
    assert r.err == (
        f"pin-and-cite: error: reading_notes/layers.md.j2:11: {MOD}#L31-L32: deleted by the bump to B: rewrite "
        "the claim, then cite; that page was left as it was, the others rendered\n"
    )
    assert (out / "layers.md").read_text() == before
    assert "L20-L22" in (out / "also.md").read_text()  # the other note renders at the new pin
    assert (out / "changes" / page_name(f"{MOD}#L31-L32")).read_text().startswith("# deleted: pkg/mod.py L31–L32\n")
    assert "| deleted |" in (out / "changes" / "index.md").read_text()

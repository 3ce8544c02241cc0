"""`relocate` end to end: a two-commit history served by a real git daemon, answers in input order, one
fetch per commit however many citations, per-citation errors, and local repositories as sources."""

import json
import os
import subprocess
from pathlib import Path

import git
import pytest

from tests.gitserver import ByteCountingProxy
from tests.tools.conftest import CLI


def relocate(source: str, *args: str, cache: Path, stdin: str | None = None):
    proc = subprocess.run(
        [str(CLI), "relocate", "--source", source, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PIN_AND_CITE_CACHE": str(cache)},
    )
    return proc


def relocate_popen(source: str, *args: str, cache: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(CLI), "relocate", "--source", source, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PIN_AND_CITE_CACHE": str(cache)},
    )


EXPECTED = [
    ("pkg/mod.py#L12-L14", "moved", [15, 17]),
    ("pkg/mod.py#L17-L19", "changed", [20, 22]),
    ("pkg/mod.py::Column.backward", "moved", [24, 25]),
    ("pkg/mod.py::helper", "changed", [28, 31]),
    ("pkg/mod.py#L31-L32", "deleted", None),
    ("docs/notes.txt#L1-L3", "unchanged", [1, 3]),
]


def test_relocate_answers_in_input_order_as_json(history, tmp_path):
    proc = relocate(history.url, "--from", "c1", "--to", "c2", "--json", *[c for c, _, _ in EXPECTED], cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    answers = json.loads(proc.stdout)
    assert [(a["cite"], a["status"], a["lines"]) for a in answers] == EXPECTED
    assert answers[3]["reason"] == "helper is gone; combine looks like it renamed"


def test_thousands_of_citations_cost_the_same_requests_as_one_per_file(history, daemon, tmp_path):
    """The network work is per commit and per file, never per citation: count git connections and objects."""
    proxy = ByteCountingProxy(daemon.port)
    url = daemon.url("reloc.git", proxy.port)
    few = "pkg/mod.py#L1-L1\ndocs/notes.txt#L1-L1\n"
    many = "".join(f"pkg/mod.py#L{a}-L{min(32, a + k)}\n" for a in range(1, 33) for k in range(0, 40, 2))
    many += "".join(f"docs/notes.txt#L{a}-L3\n" for a in (1, 2, 3)) * 100 + "pkg/mod.py::Column.forward\n" * 500
    counts = []
    for n, text in enumerate((few, many)):
        proxy.reset()
        proc = relocate(
            url, "--from", history.c1, "--to", history.c2, "--json", "-", cache=tmp_path / str(n), stdin=text
        )
        assert proc.returncode == 0, proc.stderr
        assert len(json.loads(proc.stdout)) == text.count("\n")
        counts.append(proxy.connections)
        [git_dir] = [d for d in (tmp_path / str(n) / "git").iterdir() if d.is_dir()]
        listing = git.Repo(git_dir).git.execute(["git", "cat-file", "--batch-all-objects", "--batch-check"])
        kinds = sorted(line.split()[1] for line in listing.splitlines())
        # 2 commits; per commit the root, pkg/ and docs/ trees (4 distinct trees: docs/ changed too);
        # blobs: mod.py and notes.txt at each commit
        assert kinds == ["blob"] * 4 + ["commit"] * 2 + ["tree"] * 6
    assert text.count("\n") > 1000
    # per commit: the commit, the root tree, then pkg/ and docs/ together; then one request for every blob
    assert counts == [2 * 3 + 1, 2 * 3 + 1]


def test_per_citation_errors_leave_the_others_answered(history, tmp_path):
    cites = [
        "pkg/gone.py#L1-L1",
        "pkg/absent.py#L1-L1",
        "docs/notes.txt::alpha",
        "pkg/mod.py#L30-L40",
        "pkg/mod.py#Lx",
        "pkg/mod.py#L12-L14",
    ]
    proc = relocate(history.url, "--from", history.c1, "--to", "c2", "--json", *cites, cache=tmp_path)
    assert proc.returncode == 1
    answers = json.loads(proc.stdout)
    assert [a["status"] for a in answers] == ["deleted"] + ["error"] * 4 + ["moved"]
    assert [a.get("reason") for a in answers[:5]] == [
        f"pkg/gone.py does not exist at {history.c2[:12]}, and the cited code is not found in another file",
        f"pkg/absent.py does not exist at {history.c1[:12]}",
        "docs/notes.txt is not a Python file; cite it by line range",
        f"L30-L40 is past the end of pkg/mod.py at {history.c1[:12]} (32 lines)",
        "malformed citation 'pkg/mod.py#Lx': expected PATH#Lstart-Lend or PATH::Qual.name",
    ]


@pytest.mark.parametrize(
    "old, message",
    [
        ("0123456789abcdef0123456789abcdef01234567", "has no commit 0123456789abcdef0123456789abcdef01234567"),
        ("no-such-tag", "has no tag or branch named 'no-such-tag'"),
    ],
)
def test_unknown_commits_are_one_clear_line(history, tmp_path, old, message):
    proc = relocate(history.url, "--from", old, "--to", "c2", "pkg/mod.py#L1-L2", cache=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stderr.startswith("pin-and-cite: error: ") and proc.stderr.count("\n") == 1


def test_a_local_repository_directory_is_a_source(history, tmp_path):
    proc = relocate(
        str(history.work),
        "--from",
        history.c1,
        "--to",
        "c2",
        "pkg/mod.py#L12-L14",
        "pkg/mod.py::helper",
        cache=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "moved     pkg/mod.py#L12-L14 -> L15-L17",
        "changed   pkg/mod.py::helper -> L28-L31  (helper is gone; combine looks like it renamed)",
    ]


def test_help_documents_the_verbs_and_statuses():
    out = subprocess.run([str(CLI), "--help"], capture_output=True, text=True).stdout
    assert "bump" in out and "relocate" in out
    for status in ("unchanged", "moved", "changed", "deleted", "error"):
        assert f"  {status}" in out
    out = subprocess.run([str(CLI), "relocate", "--help"], capture_output=True, text=True).stdout
    assert "PATH#Lstart-Lend" in out and "'-' reads one per line from stdin" in out

"""default(SPEC, param): a parameter's default read from the pinned source, locked, checked, and carried by bump.

A synthetic upstream (two commits served by `git daemon` on 127.0.0.1) declares defaults in a signature, as
keyword-only parameters and as dataclass fields; the second commit flips one, drops one and moves the class
down, as real history does.
"""

from __future__ import annotations

import json

import git
import pytest

from tests.tools.conftest import FREE_FORM, _write

V1 = '''\
from dataclasses import dataclass, field


class Wrapper:
    def __init__(self, module, strategy=None, *, forward_prefetch: bool = False,
                 limit_all_gathers: bool = True, device_id):
        self.module = module


@dataclass
class Config:
    overlap_grad_reduce: bool = False
    """Whether to overlap."""
    bucket_size: int = field(default=40_000_000)
    buckets: list = field(default_factory=list)
    ratio: tuple = (1,
                    2)
'''
V2 = "# a new header line\n" + V1.replace("forward_prefetch: bool = False", "forward_prefetch: bool = True").replace(
    "                 limit_all_gathers: bool = True, device_id", "                 device_id"
)
WRAPPER = "up:pkg/fsdp.py::Wrapper.__init__"
CONFIG = "up:pkg/fsdp.py::Config"


@pytest.fixture(scope="module")
def flipped(daemon, tmp_path_factory):
    work = git.Repo.init(tmp_path_factory.mktemp("defaults-work"))
    actor = git.Actor("Upstream", "upstream@example.com")
    commits = []
    for text in (V1, V2):
        _write(work, {"pkg/fsdp.py": text.encode()})
        commits.append(work.index.commit("c", author=actor, committer=actor).hexsha)
    bare = daemon.base / "defaults.git"
    work.clone(bare, bare=True)
    return daemon.url("defaults.git"), commits


@pytest.fixture
def pinned(project, flipped):
    url, (v1, _) = flipped
    project.write_pins(up={"url": url, "commit": v1})
    return project


def note(project, text):
    (project.root / "reading_notes" / "n.md.j2").write_text(FREE_FORM + text)


def test_cite_default_locks_what_the_source_writes(pinned):
    r = pinned.run("cite", "--default", "forward_prefetch", "--default", "limit_all_gathers", WRAPPER, "--json")
    assert r.code == 0, r.err
    assert [(row["default"], row["value"], row["line"]) for row in r.json()] == [
        (f"{WRAPPER}(forward_prefetch)", "False", 5),
        (f"{WRAPPER}(limit_all_gathers)", "True", 6),
    ]
    r = pinned.run("cite", "--default", "overlap_grad_reduce", "--default", "bucket_size", "--default", "ratio", CONFIG)
    assert r.code == 0, r.err
    assert r.out.splitlines()[1].endswith("bucket_size=40_000_000 (L14)")
    lock = json.loads(pinned.lock_path.read_text())
    assert lock["defaults"] == {
        f"{WRAPPER}(forward_prefetch)": {"value": "False", "line": 5},
        f"{WRAPPER}(limit_all_gathers)": {"value": "True", "line": 6},
        f"{CONFIG}(overlap_grad_reduce)": {"value": "False", "line": 12},
        f"{CONFIG}(bucket_size)": {"value": "40_000_000", "line": 14},
        f"{CONFIG}(ratio)": {"value": "(1,\n                    2)", "line": 16},
    }
    assert list(lock["files"]) == ["up:pkg/fsdp.py"]


@pytest.mark.parametrize(
    "param, spec, message",
    [
        ("device_id", WRAPPER, "parameter 'device_id' of Wrapper.__init__ in pkg/fsdp.py at up@"),
        ("buckets", CONFIG, "field 'buckets' of Config in pkg/fsdp.py at up@"),
        ("backward_prefetch", WRAPPER, "Wrapper.__init__ in pkg/fsdp.py at up@"),
        ("x", "up:pkg/fsdp.py#L4-L6", "default('up:pkg/fsdp.py#L4-L6', ...) needs SOURCE:PATH::Qual.name"),
        ("not-a-name", WRAPPER, "the parameter must be a Python name"),
    ],
)
def test_a_default_that_is_not_there_is_one_line(pinned, param, spec, message):
    r = pinned.run("cite", "--default", param, spec)
    assert r.code == 2 and message in r.err and r.err.count("\n") == 1, r.err
    assert not pinned.lock_path.exists()


def test_a_note_renders_the_default_and_check_proves_it(pinned):
    assert pinned.run("cite", "--default", "forward_prefetch", WRAPPER).code == 0
    note(pinned, "FSDP prefetches forward only with {{ default('" + WRAPPER + "', 'forward_prefetch') }}.\n")
    assert pinned.run("render").code == 0
    page = (pinned.root / "docs" / "notes" / "n.md").read_text()
    assert page == FREE_FORM + "FSDP prefetches forward only with `forward_prefetch=False`.\n"
    assert pinned.run("check").code == 0

    lock = json.loads(pinned.lock_path.read_text())
    lock["defaults"][f"{WRAPPER}(forward_prefetch)"]["value"] = "True"  # a lock that lies
    pinned.lock_path.write_text(json.dumps(lock))
    r = pinned.run("check")
    assert (
        r.code == 1
        and f"reading_notes/n.md.j2:4: {WRAPPER}(forward_prefetch): the default is now "
        "forward_prefetch=False at L5; the lock says forward_prefetch=True at L5"
        in r.out
    )

    note(pinned, "{{ default('" + WRAPPER + "', 'limit_all_gathers') }}\n{{ default('" + WRAPPER + "') }}\n")
    r = pinned.run("check")
    assert r.code == 1
    assert (
        f"reading_notes/n.md.j2:4: {WRAPPER}(limit_all_gathers): not in the lock; run `tools/pin-and-cite "
        f"cite --default limit_all_gathers {WRAPPER}` on it" in r.out
    )
    assert f"reading_notes/n.md.j2:5: {WRAPPER}: default() takes two literal strings" in r.out


def test_bump_reports_a_changed_default_and_drops_a_vanished_one(pinned, flipped):
    _, (v1, v2) = flipped
    assert pinned.run("cite", "--default", "forward_prefetch", "--default", "limit_all_gathers", WRAPPER).code == 0
    assert pinned.run("cite", "--default", "overlap_grad_reduce", CONFIG).code == 0
    note(
        pinned,
        "{{ default('" + WRAPPER + "', 'forward_prefetch') }} {{ default('" + CONFIG + "', 'overlap_grad_reduce') }}\n",
    )
    r = pinned.run("bump", "up", "--ref", v2, "--json")
    assert r.code == 0, r.err
    assert r.json()["defaults"] == [
        {"default": f"{WRAPPER}(forward_prefetch)", "old": "False", "new": "True"},
        {"default": f"{WRAPPER}(limit_all_gathers)", "old": "True", "new": None},
    ]
    lock = json.loads(pinned.lock_path.read_text())
    assert lock["defaults"] == {
        f"{WRAPPER}(forward_prefetch)": {"value": "True", "line": 6},
        f"{CONFIG}(overlap_grad_reduce)": {"value": "False", "line": 13},
    }
    assert lock["bumps"]["up"]["defaults"] == {
        f"{WRAPPER}(forward_prefetch)": {"old_value": "False", "new_value": "True"},
        f"{WRAPPER}(limit_all_gathers)": {"old_value": "True", "new_value": None},
    }
    assert lock["files"]["up:pkg/fsdp.py"]["commit"] == v2
    assert pinned.run("check").code == 0  # the note renders the new value; the report asks for a re-read
    gone = f"{WRAPPER}(limit_all_gathers): the bump to {v2[:12]} removed this default: rewrite the claim"
    note(pinned, "{{ default('" + WRAPPER + "', 'limit_all_gathers') }}\n")
    r = pinned.run("check")  # check and cite give the same advice, and neither says to lock it
    assert r.code == 1 and f"reading_notes/n.md.j2:4: {gone}" in r.out, r.out
    r = pinned.run("cite", "--default", "limit_all_gathers", WRAPPER)
    assert r.code == 2 and r.err == f"pin-and-cite: error: {gone}\n", r.err
    r = pinned.run("render")  # render too (it said to `cite --default` it)
    assert r.code == 2 and f"reading_notes/n.md.j2:4: {gone};" in r.err and "cite --default" not in r.err, r.err
    note(pinned, "{{ default('" + WRAPPER + "', 'forward_prefetch') }}\n")
    assert pinned.run("render").code == 0
    index = (pinned.root / "docs" / "notes" / "changes" / "index.md").read_text()
    assert f"| `{WRAPPER}(forward_prefetch)` | `False` | `True` |" in index
    assert f"| `{WRAPPER}(limit_all_gathers)` | `True` | gone |" in index


def test_a_default_holding_backticks_renders_as_text_never_as_html(project, daemon, tmp_path):
    """The default's text is upstream's: backticks in it must not end the code span it is shown in."""
    import markdown

    from tests.tools.conftest import serve_history

    source = 'def f(a="`<script>alert(1)</script>`", b="``x``"):\n    return a\n'
    served = serve_history(daemon, tmp_path / "ticks", "ticks", [{"pkg/f.py": source.encode()}, {"README": b"c2\n"}])
    project.write_pins(up={"url": served.url, "commit": served.c1})
    assert project.run("cite", "--default", "a", "--default", "b", "up:pkg/f.py::f").code == 0
    note(project, "{{ default('up:pkg/f.py::f', 'a') }} and {{ default('up:pkg/f.py::f', 'b') }}\n")
    assert project.run("render").code == 0
    html = markdown.markdown((project.root / "docs" / "notes" / "n.md").read_text())
    assert "<script>" not in html
    assert '<code>a="`&lt;script&gt;alert(1)&lt;/script&gt;`"</code>' in html
    assert '<code>b="``x``"</code>' in html

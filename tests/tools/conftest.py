"""Fixtures for pin-and-cite: a synthetic upstream served by a real `git daemon`, and a project pinning it."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import git
import pytest

from tests.gitserver import GitDaemon
from tests.tools.synthetic import BASE, HEADER, edited

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "tools" / "pin-and-cite"
FREE_FORM = "---\nrules: none\n---\n"  # a page that keeps no structure rules (study/note_rules.py)
STUDY_PLUGIN = '[site]\nplugin = "study.plugin"\n\n'  # the helpers and note rules of this study (tools/study)

LAYERS_PY = '''\
"""A stand-in for an upstream module with decorated methods."""
import functools


def traced(fn):
    return fn


class ColumnParallel:
    """Splits the output dimension."""

    @staticmethod
    @traced
    def forward(ctx, x):
        return x

    def backward(self, grad):
        return grad


if True:
    def twice():
        return 1
else:
    def twice():
        return 2
'''


@dataclass
class Upstream:
    path: Path  # bare repository served by the daemon
    url: str
    v1: str  # commit SHAs
    v2: str
    files: dict  # path -> bytes at v1


def interruptible() -> None:
    """In a child about to run the tool: Ctrl-C (SIGINT) acts as from a terminal, whatever the test process
    inherited (a process may start with SIGINT ignored or blocked, and its children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _write(repo: git.Repo, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        target = Path(repo.working_tree_dir) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    repo.index.add(list(files))


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    served = tmp_path_factory.mktemp("served")
    d = GitDaemon(served)
    yield d
    d.stop()


@pytest.fixture(scope="session")
def upstream(daemon, tmp_path_factory) -> Upstream:
    """A repository with two small cited modules and 4 MB of incompressible files nobody cites."""
    work = git.Repo.init(tmp_path_factory.mktemp("work"))
    actor = git.Actor("Upstream", "upstream@example.com")
    rng = random.Random(0)
    files = {
        "pkg/core/layers.py": LAYERS_PY.encode(),
        "pkg/core/mappings.py": "".join(f"def region_{i}():\n    return {i}\n\n\n" for i in range(40)).encode(),
        "pkg/core/ticks.py": b'def example():\n    """Usage:\n\n    ````python\n    example()\n    ````\n    """\n',
        "git/__init__.py": b"# same path as GitPython's, other bytes\n",
        **{f"assets/blob_{i}.bin": rng.randbytes(200_000) for i in range(20)},
    }
    _write(work, files)
    v1 = work.index.commit("v1", author=actor, committer=actor)
    work.create_tag("v1", message="release v1")
    _write(work, {"pkg/core/layers.py": b"# moved down\n" + LAYERS_PY.encode()})
    v2 = work.index.commit("v2", author=actor, committer=actor)
    bare = daemon.base / "upstream.git"
    work.clone(bare, bare=True)
    return Upstream(bare, daemon.url("upstream.git"), v1.hexsha, v2.hexsha, files)


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


class ProjectDir:
    """A scratch project pinning the synthetic upstream, with its own cache."""

    def __init__(self, root: Path, cache: Path):
        self.root, self.cache = root, cache
        (root / "reading_notes").mkdir(parents=True)

    @property
    def lock_path(self) -> Path:
        return self.root / "reading_notes" / "citations.lock"

    @property
    def pins_path(self) -> Path:
        return self.root / "reading_notes" / "pins.toml"

    def write_pins(self, **sources: dict) -> None:
        """pins.toml with these [sources.NAME] tables, under this study's plugin (its helpers and note rules)."""
        text = "".join(
            f"[sources.{name}]\n" + "".join(f'{k} = "{v}"\n' for k, v in table.items()) + "\n"
            for name, table in sources.items()
        )
        self.pins_path.write_text(STUDY_PLUGIN + text)  # first: a test appends keys to the last source

    def run(self, *args: str, timeout: float = 60, env: dict | None = None) -> Run:
        proc = subprocess.run(
            [str(CLI), *args, "--project", str(self.root)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PIN_AND_CITE_CACHE": str(self.cache), **(env or {})},
        )
        return Run(proc.returncode, proc.stdout, proc.stderr)

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [str(CLI), *args, "--project", str(self.root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=interruptible,
            env={**os.environ, "PIN_AND_CITE_CACHE": str(self.cache)},
        )


@pytest.fixture
def project(tmp_path, upstream) -> ProjectDir:
    p = ProjectDir(tmp_path / "project", tmp_path / "cache")
    p.write_pins(up={"url": upstream.url, "commit": upstream.v1})
    return p


TEXT = "alpha\nbeta\ngamma\n"


@dataclass
class History:
    work: Path  # the working repository (also usable as a local source)
    url: str
    c1: str
    c2: str


def serve_history(daemon, work_dir: Path, name: str, commits: list[dict[str, bytes | None]]) -> History:
    """A repository whose commits set these files (None removes one), tagged c1, c2, ..., served by the
    daemon as NAME.git; c1 and c2 are its first two commits."""
    work = git.Repo.init(work_dir)
    actor = git.Actor("Upstream", "upstream@example.com")
    shas = []
    for n, files in enumerate(commits, 1):
        _write(work, {rel: data for rel, data in files.items() if data is not None})
        removed = [rel for rel, data in files.items() if data is None]
        if removed:
            work.index.remove(removed, working_tree=True)
        shas.append(work.index.commit(f"c{n}", author=actor, committer=actor).hexsha)
        work.create_tag(f"c{n}")
    work.clone(daemon.base / f"{name}.git", bare=True)
    return History(work_dir, daemon.url(f"{name}.git"), *shas[:2])


@pytest.fixture(scope="session")
def history(daemon, tmp_path_factory) -> History:
    """c1 -> c2: pkg/mod.py gains a header, edits forward, renames helper, drops other; notes.txt turns CRLF;
    gone.py goes."""
    work_dir = tmp_path_factory.mktemp("reloc-work")
    work = git.Repo.init(work_dir)
    actor = git.Actor("Upstream", "upstream@example.com")

    def commit(files: dict[str, str], message: str, removed=()) -> str:
        _write(work, {rel: text.encode() for rel, text in files.items()})
        if removed:
            work.index.remove(list(removed), working_tree=True)
        return work.index.commit(message, author=actor, committer=actor).hexsha

    c1 = commit({"pkg/mod.py": BASE, "docs/notes.txt": TEXT, "pkg/gone.py": "x = 1\n"}, "c1")
    work.create_tag("c1")
    c2 = commit(
        {
            "pkg/mod.py": HEADER
            + edited(
                ("y = y + 1", "y = y + 2"),
                ("def helper(", "def combine("),
                ("\n\n\ndef other(a):\n    return a\n", "\n"),
            ),
            "docs/notes.txt": TEXT.replace("\n", "\r\n"),
        },
        "c2",
        removed=["pkg/gone.py"],
    )
    work.create_tag("c2")
    bare = daemon.base / "reloc.git"
    work.clone(bare, bare=True)
    return History(work_dir, daemon.url("reloc.git"), c1, c2)

"""Citations that follow code into another file: a history shaped like Megatron-LM 0.10.0's moves (methods
moved with identical text into a new base-class file, a file renamed and edited), served by a real git daemon.

c1 -> c2 in dist/ (synthetic code):
  ddp.py: forward, state_dict and load_state_dict move, same text, into the new base.py (class BaseDP);
  grad_buffer.py is renamed param_and_grad_buffer.py, with reset's body edited and a method appended;
  helpers.py: scale goes and a similar scale_all appears in ops.py; twin goes and two identical copies of it
  appear in a_copy.py and b_copy.py; gone goes for good;
  far_away goes from helpers.py into deep/inner/dest.py (another top-level directory);
  far/ (another top-level directory) changes 2 MB of files that no answer needs; still/ does not change.
"""

import json
import os
import random
import subprocess

import git
import pytest

from pin_and_cite.site.changes import page_name
from tests.gitserver import ByteCountingProxy
from tests.tools.conftest import CLI, FREE_FORM, serve_history

DDP_METHODS = '''\
    def forward(self, *inputs, **kwargs):
        """Run the wrapped module."""
        return self.module(*inputs, **kwargs)

    def state_dict(self, prefix="", keep_vars=False):
        """The wrapped module's state."""
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict=True):
        """Load into the wrapped module."""
        self.module.load_state_dict(state_dict, strict=strict)
'''
DDP_OLD = (
    '''\
"""Data parallel wrapper."""
import contextlib


class DDP:
    """Overlaps gradient reduction with backward."""

    def __init__(self, module, buckets):
        self.module = module
        self.buckets = buckets

'''
    + DDP_METHODS
    + """
    def zero_grad(self):
        for bucket in self.buckets:
            bucket.reset()
"""
)
DDP_NEW = '''\
"""Data parallel wrapper."""
import contextlib

from .base import BaseDP


class DDP(BaseDP):
    """Overlaps gradient reduction with backward."""

    def __init__(self, module, buckets):
        super().__init__(module)
        self.buckets = buckets

    def zero_grad(self):
        for bucket in self.buckets:
            bucket.reset()
'''
BASE_NEW = (
    '''\
"""What every data-parallel wrapper shares."""


class BaseDP:
    """A module wrapper."""

    def __init__(self, module):
        self.module = module

'''
    + DDP_METHODS
)
GRAD_BUFFER = '''\
"""Contiguous gradient buffers."""


class GradBuffer:
    """One flat buffer per dtype."""

    def __init__(self, numel, dtype):
        self.numel = numel
        self.dtype = dtype
        self.data = [0] * numel

    def reset(self):
        self.data = [0] * self.numel

    def view(self, start, end):
        return self.data[start:end]
'''
PARAM_AND_GRAD_BUFFER = (
    GRAD_BUFFER.replace("        self.data = [0] * self.numel\n", "        self.data = [0.0] * self.numel\n")
    + """
    def scale(self, factor):
        self.data = [x * factor for x in self.data]
"""
)
SCALE = '''\
def scale(values, factor):
    """Multiply every value by factor."""
    out = []
    for v in values:
        out.append(v * factor)
    return out
'''
TWIN = """\
def twin(a, b):
    total = a + b
    total = total * 2
    return total
"""
FAR_AWAY = "def far_away(path):\n    with open(path) as f:\n        return f.read()\n"
HELPERS_OLD = '"""Helpers."""\n\n\n' + SCALE + "\n\n" + TWIN + "\n\ndef gone(x):\n    return x - 1\n\n\n" + FAR_AWAY
HELPERS_NEW = '"""Helpers."""\n\n\ndef kept():\n    return 0\n'
OPS_NEW = '"""Ops."""\n\n\n' + SCALE.replace("def scale(", "def scale_all(").replace(
    "out.append(v * factor)", "out.append(v * factor + 0)"
)
BROKEN_OLD = "def f():\n    return 1\n"


def lines_of(text: str, first: str, count: int) -> list[int]:
    """[start, end] (1-based) of the `count` lines of `text` starting at the line equal to `first`."""
    start = text.split("\n").index(first) + 1
    return [start, start + count - 1]


def far_files(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {
        f"far/big_{i}.py": "".join(f"x_{rng.getrandbits(64):x} = {rng.getrandbits(64)}\n" for _ in range(5000)).encode()
        for i in range(4)
    }


@pytest.fixture(scope="module")
def moves(daemon, tmp_path_factory):
    c1 = {
        "dist/ddp.py": DDP_OLD,
        "dist/grad_buffer.py": GRAD_BUFFER,
        "dist/helpers.py": HELPERS_OLD,
        "dist/broken.py": BROKEN_OLD,
        "still/same.py": "def same():\n    return 1\n",
    }
    c2 = {
        "dist/ddp.py": DDP_NEW,
        "dist/base.py": BASE_NEW,
        "dist/grad_buffer.py": None,
        "dist/param_and_grad_buffer.py": PARAM_AND_GRAD_BUFFER,
        "dist/helpers.py": HELPERS_NEW,
        "dist/ops.py": OPS_NEW,
        "dist/a_copy.py": '"""A."""\n\n\n' + TWIN,
        "dist/b_copy.py": '"""B."""\n\n\n' + TWIN,
        "dist/broken.py": "def f(:\n",
        "deep/inner/dest.py": '"""Dest."""\n\n\n' + FAR_AWAY,
    }
    return serve_history(
        daemon,
        tmp_path_factory.mktemp("moves-work"),
        "moves",
        [
            {**{k: v.encode() for k, v in c1.items()}, **far_files(1)},
            {**{k: v.encode() if v is not None else None for k, v in c2.items()}, **far_files(2)},
        ],
    )


def relocate(url: str, *cites: str, cache) -> list[dict]:
    proc = subprocess.run(
        [str(CLI), "relocate", "--source", url, "--from", "c1", "--to", "c2", "--json", *cites],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PIN_AND_CITE_CACHE": str(cache)},
    )
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def answers(url: str, cache, *cites: str) -> dict[str, tuple]:
    return {
        a["cite"]: (a["status"], a["path"], a["lines"], a.get("symbol")) for a in relocate(url, *cites, cache=cache)
    }


FORWARD_OLD = lines_of(DDP_OLD, "    def forward(self, *inputs, **kwargs):", 3)
FORWARD_NEW = lines_of(BASE_NEW, "    def forward(self, *inputs, **kwargs):", 3)


def test_methods_moved_with_identical_text_into_a_new_file_are_moved_with_the_path(moves, tmp_path):
    state_new = lines_of(BASE_NEW, '    def state_dict(self, prefix="", keep_vars=False):', 3)
    zero_old = lines_of(DDP_OLD, "    def zero_grad(self):", 3)
    zero_new = lines_of(DDP_NEW, "    def zero_grad(self):", 3)
    body = f"dist/ddp.py#L{FORWARD_OLD[0] + 1}-L{FORWARD_OLD[1]}"
    assert answers(
        moves.url,
        tmp_path,
        "dist/ddp.py::DDP.forward",
        "dist/ddp.py::DDP.state_dict",
        body,
        "dist/ddp.py::DDP.zero_grad",
    ) == {
        "dist/ddp.py::DDP.forward": ("moved", "dist/base.py", FORWARD_NEW, "BaseDP.forward"),
        "dist/ddp.py::DDP.state_dict": ("moved", "dist/base.py", state_new, "BaseDP.state_dict"),
        body: ("moved", "dist/base.py", [FORWARD_NEW[0] + 1, FORWARD_NEW[1]], None),
        "dist/ddp.py::DDP.zero_grad": ("moved", "dist/ddp.py", zero_new, None),  # stayed: same file
    }
    assert zero_old != zero_new


def test_a_renamed_file_takes_its_citations_along(moves, tmp_path):
    init = lines_of(GRAD_BUFFER, "    def __init__(self, numel, dtype):", 4)
    reset = lines_of(GRAD_BUFFER, "    def reset(self):", 2)
    found = relocate(
        moves.url,
        f"dist/grad_buffer.py#L{init[0]}-L{init[1]}",
        "dist/grad_buffer.py::GradBuffer.view",
        "dist/grad_buffer.py::GradBuffer.reset",
        cache=tmp_path,
    )
    new = "dist/param_and_grad_buffer.py"
    assert [(a["status"], a["path"], a["lines"]) for a in found] == [
        ("unchanged", new, init),
        ("unchanged", new, lines_of(GRAD_BUFFER, "    def view(self, start, end):", 2)),
        ("changed", new, reset),
    ]
    assert found[2]["reason"] == f"dist/grad_buffer.py is now {new}"


def test_a_similar_body_elsewhere_is_changed(moves, tmp_path):
    scale = lines_of(HELPERS_OLD, "def scale(values, factor):", 6)
    scale_all = lines_of(OPS_NEW, "def scale_all(values, factor):", 6)
    found = relocate(
        moves.url, "dist/helpers.py::scale", f"dist/helpers.py#L{scale[0] + 1}-L{scale[1]}", cache=tmp_path
    )
    assert [(a["status"], a["path"], a["lines"]) for a in found] == [
        ("changed", "dist/ops.py", scale_all),
        ("changed", "dist/ops.py", [scale_all[0] + 1, scale_all[1]]),
    ]
    assert found[0]["reason"] == "scale is gone from dist/helpers.py; scale_all in dist/ops.py looks like it"


def test_identical_copies_in_two_files_are_changed_never_moved(moves, tmp_path):
    twin = lines_of(HELPERS_OLD, "def twin(a, b):", 4)
    copy = lines_of('"""A."""\n\n\n' + TWIN, "def twin(a, b):", 4)
    found = relocate(moves.url, "dist/helpers.py::twin", f"dist/helpers.py#L{twin[0] + 1}-L{twin[1]}", cache=tmp_path)
    assert [(a["status"], a["path"], a["lines"]) for a in found] == [
        ("changed", "dist/a_copy.py", copy),
        ("changed", "dist/a_copy.py", [copy[0] + 1, copy[1]]),
    ]
    assert {a["reason"] for a in found} == {
        "2 identical copies in other files (dist/a_copy.py, dist/b_copy.py); check this is the one meant"
    }


def test_code_that_is_gone_everywhere_is_deleted(moves, tmp_path):
    gone = lines_of(HELPERS_OLD, "def gone(x):", 2)
    found = relocate(moves.url, "dist/helpers.py::gone", f"dist/helpers.py#L{gone[0]}-L{gone[1]}", cache=tmp_path)
    assert [(a["status"], a["path"], a["lines"]) for a in found] == [("deleted", None, None)] * 2


def test_only_the_trees_near_the_path_and_the_changed_files_there_are_fetched(moves, daemon, tmp_path):
    """The answer is in the cited file's directory: far/ (2 MB that changed) is never fetched, nor any tree of it."""
    proxy = ByteCountingProxy(daemon.port)
    found = relocate(daemon.url("moves.git", proxy.port), "dist/ddp.py::DDP.forward", cache=tmp_path)
    assert (found[0]["status"], found[0]["path"]) == ("moved", "dist/base.py")
    [git_dir] = [p for p in (tmp_path / "git").iterdir() if p.suffix != ".lock"]  # beside it: its file lock
    listing = git.Repo(git_dir).git.execute(["git", "cat-file", "--batch-all-objects", "--batch-check"])
    kinds = sorted(line.split()[1] for line in listing.splitlines())
    # commits 2; trees: root and dist/ at each commit; blobs: ddp.py at both, and the 7 changed .py files of
    # dist/ at c2 (base, ops, a_copy, b_copy, broken, helpers, param_and_grad_buffer)
    assert kinds == ["blob"] * 9 + ["commit"] * 2 + ["tree"] * 4
    assert proxy.sent_to_client < 40_000, proxy.sent_to_client


def test_code_moved_far_away_is_found_in_the_whole_tree_without_opening_unchanged_trees(moves, tmp_path):
    found = relocate(moves.url, "dist/helpers.py::far_away", cache=tmp_path)
    assert [(a["status"], a["path"], a["lines"]) for a in found] == [("moved", "deep/inner/dest.py", [4, 6])]
    [git_dir] = [p for p in (tmp_path / "git").iterdir() if p.suffix != ".lock"]  # beside it: its file lock
    listing = git.Repo(git_dir).git.execute(["git", "cat-file", "--batch-all-objects", "--batch-check"])
    cached = {line.split()[0] for line in listing.splitlines()}  # what is there: never a lazy fetch
    work = git.Repo(moves.work)
    assert work.git.rev_parse("c2:deep/inner") in cached
    unchanged = work.git.rev_parse("c2:still")
    assert unchanged == work.git.rev_parse("c1:still") and unchanged not in cached


@pytest.fixture
def noted_moves(project, moves):
    project.write_pins(up={"url": moves.url, "commit": moves.c1, "tag": "c1"})
    init = lines_of(GRAD_BUFFER, "    def __init__(self, numel, dtype):", 4)
    specs = [
        "up:dist/ddp.py::DDP.forward",
        f"up:dist/ddp.py#L{FORWARD_OLD[0] + 1}-L{FORWARD_OLD[1]}",
        f"up:dist/grad_buffer.py#L{init[0]}-L{init[1]}",
        "up:dist/grad_buffer.py::GradBuffer.reset",
    ]
    note = project.root / "reading_notes" / "dp.md.j2"
    note.write_text(FREE_FORM + "".join(f"- {{{{ cite('{spec}') }}}}\n" for spec in specs))
    r = project.run("cite", *specs)
    assert r.code == 0, r.err
    return note


def test_bump_rewrites_the_path_in_the_note_and_the_lock_and_check_passes(project, moves, noted_moves):
    r = project.run("bump", "up", "--ref", "c2", "--json")
    assert r.code == 0, r.err
    init = lines_of(GRAD_BUFFER, "    def __init__(self, numel, dtype):", 4)
    reset_new = lines_of(PARAM_AND_GRAD_BUFFER, "    def reset(self):", 2)
    new_specs = [
        "up:dist/base.py::BaseDP.forward",
        f"up:dist/base.py#L{FORWARD_NEW[0] + 1}-L{FORWARD_NEW[1]}",
        f"up:dist/param_and_grad_buffer.py#L{init[0]}-L{init[1]}",
        "up:dist/param_and_grad_buffer.py::GradBuffer.reset",
    ]
    assert noted_moves.read_text() == FREE_FORM + "".join(f"- {{{{ cite('{spec}') }}}}\n" for spec in new_specs)
    assert [c["new_cite"] for c in r.json()["citations"]] == new_specs
    lock = json.loads(project.lock_path.read_text())
    assert sorted(lock["citations"]) == sorted(new_specs)
    assert sorted(lock["files"]) == ["up:dist/base.py", "up:dist/param_and_grad_buffer.py"]
    record = lock["bumps"]["up"]
    assert record["counts"] == {"unchanged": 1, "moved": 2, "changed": 1, "deleted": 0}
    change = record["changes"]["up:dist/grad_buffer.py::GradBuffer.reset"]
    assert (change["status"], change["new_path"], change["new_cite"]) == (
        "changed",
        "dist/param_and_grad_buffer.py",
        new_specs[3],
    )
    assert record["files"]["dist/grad_buffer.py"]["new_blob"] is None
    check = project.run("check")
    assert check.code == 0, check.out + check.err
    assert project.run("render").code == 0
    page = project.root / "docs" / "notes" / "changes" / page_name("up:dist/grad_buffer.py::GradBuffer.reset")
    assert f"+++ dist/param_and_grad_buffer.py#L{reset_new[0]}-L{reset_new[1]} @ {moves.c2[:12]}" in page.read_text()


def test_a_citation_that_cannot_be_relocated_makes_bump_write_nothing(project, moves, noted_moves):
    noted_moves.write_text(noted_moves.read_text() + "{{ cite('up:dist/broken.py::f') }}\n")
    assert project.run("cite", "up:dist/broken.py::f").code == 0
    before = {p: p.read_bytes() for p in (project.root / "reading_notes").rglob("*") if p.is_file()}
    r = project.run("bump", "up", "--ref", "c2")
    assert r.code == 2
    assert r.err == (
        f"pin-and-cite: error: cannot bump up: 1 citation(s) cannot be relocated, e.g. "
        f"reading_notes/dp.md.j2:8: up:dist/broken.py::f: dist/broken.py is not valid Python at "
        f"{moves.c2[:12]}; cite it by line range\n"
    )
    assert {p: p.read_bytes() for p in (project.root / "reading_notes").rglob("*") if p.is_file()} == before


def test_text_output_names_the_new_file_and_name(moves, tmp_path):
    proc = subprocess.run(
        [
            str(CLI),
            "relocate",
            "--source",
            str(moves.work),
            "--from",
            "c1",
            "--to",
            "c2",
            "dist/ddp.py::DDP.forward",
            "dist/helpers.py::gone",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PIN_AND_CITE_CACHE": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"moved     dist/ddp.py::DDP.forward -> dist/base.py#L{FORWARD_NEW[0]}-L{FORWARD_NEW[1]} (BaseDP.forward)",
        "deleted   dist/helpers.py::gone -> -",
    ]


# -- code whose other copy lives in a file the commit did not change (ring 4) --------------------------------

GELU = '''\
class GeLUFunction:
    """Bias and GeLU in one kernel."""

    def forward(ctx, x, bias):
        y = x + bias
        return y * 0.5 * (1.0 + y)
'''
S3_CLIENT = '''\
class S3Client:
    """The calls the dataset makes on an object store."""

    def download_file(self, bucket, key, path):
        raise NotImplementedError
'''
TEARDOWN = "    def teardown(self):\n        self.pool.close()\n        self.pool = None\n"
TWICE = "def twice(x):\n    doubled = x * 2\n    tripled = x * 3\n    return doubled + tripled\n"
INDEXED_OLD = '"""Indexed datasets."""\n\n\n' + S3_CLIENT + "\n\nclass Loader:\n" + TEARDOWN + "\n\n" + TWICE
INDEXED_NEW = '"""Indexed datasets."""\nfrom storage.object_storage_utils import S3Client\n\n\nX = 1\n'
FILLERS = 40  # unchanged files nearer to the cited one than the survivor: more than crossfile.KEPT_FILES


@pytest.fixture(scope="module")
def kept(daemon, tmp_path_factory):
    """c1 -> c2: legacy/fused_bias_gelu.py goes (its class lives on in core/fusions/fused_bias_gelu.py); S3Client,
    Loader and twice go from core/datasets/indexed_dataset.py: S3Client lives on, imported by the new text, in
    storage/object_storage_utils.py (farther than FILLERS unchanged files in core/datasets/fillers/),
    Loader.teardown's text as Writer.teardown in core/datasets/writer.py, twice in two files beside it. No file
    holding a survivor changes."""
    unchanged = {
        "core/fusions/fused_bias_gelu.py": '"""Fused."""\n\n\n' + GELU,
        "storage/object_storage_utils.py": '"""Object storage."""\n\n\n' + S3_CLIENT,
        "core/datasets/writer.py": "class Writer:\n" + TEARDOWN,
        "core/datasets/twice_a.py": TWICE,
        "core/datasets/twice_b.py": "# b\n" + TWICE,
        **{f"core/datasets/fillers/filler_{i:02}.py": f"def filler_{i}():\n    return {i}\n" for i in range(FILLERS)},
    }
    c1 = {**unchanged, "legacy/fused_bias_gelu.py": GELU, "core/datasets/indexed_dataset.py": INDEXED_OLD}
    c2 = {"legacy/fused_bias_gelu.py": None, "core/datasets/indexed_dataset.py": INDEXED_NEW}
    return serve_history(
        daemon,
        tmp_path_factory.mktemp("kept-work"),
        "kept",
        [{k: v.encode() for k, v in c1.items()}, {k: v.encode() if v else None for k, v in c2.items()}],
    )


def test_code_kept_in_an_unchanged_file_is_moved_there_when_identical_and_under_its_name(kept, tmp_path):
    gelu = lines_of('"""Fused."""\n\n\n' + GELU, "class GeLUFunction:", 6)
    s3 = lines_of('"""Object storage."""\n\n\n' + S3_CLIENT, "class S3Client:", 5)
    body = lines_of(INDEXED_OLD, "    def download_file(self, bucket, key, path):", 2)
    assert answers(
        kept.url,
        tmp_path,
        "legacy/fused_bias_gelu.py::GeLUFunction",
        "legacy/fused_bias_gelu.py#L4-L6",
        "core/datasets/indexed_dataset.py::S3Client",
        f"core/datasets/indexed_dataset.py#L{body[0]}-L{body[1]}",
    ) == {
        "legacy/fused_bias_gelu.py::GeLUFunction": ("moved", "core/fusions/fused_bias_gelu.py", gelu, None),
        "legacy/fused_bias_gelu.py#L4-L6": ("moved", "core/fusions/fused_bias_gelu.py", [gelu[0] + 3, gelu[1]], None),
        "core/datasets/indexed_dataset.py::S3Client": ("moved", "storage/object_storage_utils.py", s3, None),
        f"core/datasets/indexed_dataset.py#L{body[0]}-L{body[1]}": (
            "moved",
            "storage/object_storage_utils.py",
            [s3[0] + 3, s3[1]],
            None,
        ),
    }


def test_identical_text_in_unchanged_files_under_another_name_or_twice_is_changed_never_moved(kept, tmp_path):
    found = relocate(
        kept.url,
        "core/datasets/indexed_dataset.py::Loader.teardown",
        "core/datasets/indexed_dataset.py::twice",
        cache=tmp_path,
    )
    assert [(a["status"], a["path"], a["lines"], a.get("symbol"), a["reason"]) for a in found] == [
        (
            "changed",
            "core/datasets/writer.py",
            [2, 4],
            "Writer.teardown",
            "identical text as Writer.teardown in files this commit did not change (core/datasets/writer.py); "
            "check this is the one meant",
        ),
        (
            "changed",
            "core/datasets/twice_a.py",
            [1, 4],
            None,
            "2 identical copies in files this commit did not change "
            "(core/datasets/twice_a.py, core/datasets/twice_b.py); check this is the one meant",
        ),
    ]


def test_the_unchanged_files_read_are_bounded_and_the_imported_one_comes_first(kept, tmp_path):
    """40 unchanged files lie nearer than S3Client's survivor; the import in the new text names it, and no more
    than KEPT_FILES nearest unchanged files (of 45) are read besides it."""
    from pin_and_cite.relocation.crossfile import KEPT_FILES

    found = relocate(kept.url, "core/datasets/indexed_dataset.py::S3Client", cache=tmp_path)
    assert (found[0]["status"], found[0]["path"]) == ("moved", "storage/object_storage_utils.py")
    [git_dir] = [p for p in (tmp_path / "git").iterdir() if p.suffix != ".lock"]
    listing = git.Repo(git_dir).git.execute(["git", "cat-file", "--batch-all-objects", "--batch-check"])
    blobs = {line.split()[0] for line in listing.splitlines() if line.split()[1] == "blob"}
    work = git.Repo(kept.work)
    cited = {work.git.rev_parse(f"{c}:core/datasets/indexed_dataset.py") for c in ("c1", "c2")}
    assert len(blobs - cited) == KEPT_FILES + 1  # the nearest, and the one imported
    assert KEPT_FILES < FILLERS


def test_bump_follows_code_kept_in_an_unchanged_file_and_check_passes(project, kept):
    project.write_pins(up={"url": kept.url, "commit": kept.c1, "tag": "c1"})
    note = project.root / "reading_notes" / "kept.md.j2"
    note.write_text(FREE_FORM + "- {{ cite('up:legacy/fused_bias_gelu.py::GeLUFunction') }}\n")
    assert project.run("cite", "up:legacy/fused_bias_gelu.py::GeLUFunction").code == 0
    r = project.run("bump", "up", "--ref", "c2", "--json")
    assert r.code == 0, r.err
    assert note.read_text() == FREE_FORM + "- {{ cite('up:core/fusions/fused_bias_gelu.py::GeLUFunction') }}\n"
    assert json.loads(project.lock_path.read_text())["bumps"]["up"]["counts"] == {
        "unchanged": 0,
        "moved": 1,
        "changed": 0,
        "deleted": 0,
    }
    check = project.run("check")
    assert check.code == 0, check.out + check.err


BLOCK_OLD = '''\
"""Blocks."""


class Block:
    def forward(self, x):
        return self._checkpointed_forward(x)

    def _checkpointed_forward(self, x):
        """Forward with activation checkpointing."""
        for layer in self.layers:
            x = layer(x)
        return x
'''
BLOCK_NEW = '''\
"""Blocks."""
from pkg.recompute import checkpointed_forward


class Block:
    def forward(self, x):
        return checkpointed_forward(self, x)
'''
RECOMPUTE = '''\
"""Recomputation, for every kind of block."""


def checkpointed_forward(block, hidden, extract_layer_indices=None, layer_offset=0):
    """Forward with activation checkpointing; the hidden states of the layers in extract_layer_indices too."""
    kept = []
    for index, layer in enumerate(block.layers):
        hidden = layer(hidden)
        if index + layer_offset in (extract_layer_indices or ()):
            kept.append(hidden)
    return (hidden, kept) if extract_layer_indices else hidden
'''


def test_a_method_replaced_by_an_imported_function_of_its_name_is_followed_there(project, daemon, tmp_path):
    """Megatron's core_v0.16.1 -> core_v0.19.0: TransformerBlock._checkpointed_forward left transformer_block.py,
    which now imports recompute.checkpointed_forward and calls it in its place; the body changed, so it is
    `changed` there, for review, never `moved` (#34: it was reported deleted)."""
    history = serve_history(
        daemon,
        tmp_path / "work",
        "recompute",
        [
            {"pkg/block.py": BLOCK_OLD.encode()},
            {"pkg/block.py": BLOCK_NEW.encode(), "pkg/recompute.py": RECOMPUTE.encode()},
        ],
    )
    project.write_pins(up={"url": history.url, "commit": history.c1})
    note = project.root / "reading_notes" / "block.md.j2"
    note.write_text(FREE_FORM + "{{ cite('up:pkg/block.py::Block._checkpointed_forward') }}\n")
    (project.root / "reference").mkdir()
    ours = project.root / "reference" / "block.py"
    ours.write_text('def forward():\n    """Mirrors `up:pkg/block.py::Block._checkpointed_forward`."""\n')
    assert project.run("cite", "up:pkg/block.py::Block._checkpointed_forward").code == 0
    r = project.run("bump", "up", "--ref", history.c2, "--json")
    assert r.code == 0, r.err
    [carried] = r.json()["citations"]
    assert (carried["status"], carried["new_cite"]) == ("changed", "up:pkg/recompute.py::checkpointed_forward")
    assert "now imports checkpointed_forward from pkg/recompute.py in its place" in carried["reason"]
    assert note.read_text() == FREE_FORM + "{{ cite('up:pkg/recompute.py::checkpointed_forward') }}\n"
    r = project.run("check")  # the docstring is left as written, and named with where its code went
    assert r.code == 1 and r.out.splitlines()[0] == (
        "reference/block.py:2: up:pkg/block.py::Block._checkpointed_forward: the bump to "
        f"{history.c2[:12]} changed this code and carried it to up:pkg/recompute.py::checkpointed_forward: "
        "check the claim, then cite that"
    ), r.out

"""`verified_by("tests/x.py::test_y")`: a note's claim names the test that demonstrates it; the test must exist.

The test also says which kind of evidence it is, read from its source by AST (never imported): a test marked
`@pytest.mark.upstream("SOURCE")` (on the function, its class, or a module-level `pytestmark`) runs the pinned
upstream implementation itself, SOURCE being the pins.toml name; any other test exercises the reference only.
A claim no upstream test can show says why with `reference_only(REASON, "detail")`, REASON from a fixed list:
free text would let "draft: later" stand in for evidence.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pin_and_cite.core.gitobj import blob_sha

if TYPE_CHECKING:
    from pin_and_cite.core.context import Context

UPSTREAM_MARK = "upstream"
# Why upstream cannot run on a CPU-only machine with gloo; a new kind of reason is a change to this tool, reviewed.
REFERENCE_ONLY_REASONS = ("APEX", "Transformer Engine", "CUDA-only", "NCCL-only", "multi-node")


def reference_only_problem(reason: object) -> str | None:
    """Why `reason` is not one reference_only() accepts, or None."""
    if reason in REFERENCE_ONLY_REASONS:
        return None
    return f"reference_only({reason!r}): the reason must be one of {', '.join(REFERENCE_ONLY_REASONS)}"


@dataclass(frozen=True)
class Evidence:
    """What a named test proves a claim on: "upstream" (with the pinned source it runs) or "reference"; and
    the lines of the test file it spans, decorators included (for the page that shows it)."""

    kind: str
    source: str | None = None
    lines: tuple[int, int] | None = field(default=None, compare=False)


def _upstream_source(decorators: list[ast.expr]) -> str | None | bool:
    """The SOURCE of a `pytest.mark.upstream("SOURCE")` among decorators (or a pytestmark value); False if none."""
    for node in decorators:
        for mark in node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]:
            call = mark if isinstance(mark, ast.Call) else None
            target = call.func if call else mark
            if (
                isinstance(target, ast.Attribute)
                and target.attr == UPSTREAM_MARK
                and isinstance(target.value, ast.Attribute)
                and target.value.attr == "mark"
            ):
                args = call.args if call else []
                source = args[0].value if args and isinstance(args[0], ast.Constant) else None
                return source if isinstance(source, str) else None  # b"x", 1j, ...: names no source
    return False


def _tests_in(path: Path, context: Context) -> dict[str, Evidence] | str:
    """Test name (or Class::name) -> its evidence; a string says why the file cannot be read as Python. Cached
    per file version (`mkdocs serve` renders again after a test file is edited, and its page must show the new
    lines), and, in a context with a parse cache, kept on disk by the file's blob SHA."""
    parsed = context.parsed
    stat = path.stat()
    version = (path, stat.st_mtime_ns, stat.st_size)
    if version not in _SEEN:
        data = path.read_bytes()
        _SEEN[version] = (
            parsed.get(blob_sha(data), "tests", lambda: _as_json(_read_tests(path, data)), _from_json)
            if parsed
            else _read_tests(path, data)
        )
    return _SEEN[version]


_SEEN: dict[tuple[Path, int, int], dict[str, Evidence] | str] = {}  # by (path, mtime, size): one per version


def _as_json(found: dict[str, Evidence] | str):
    return found if isinstance(found, str) else {name: [e.kind, e.source, list(e.lines)] for name, e in found.items()}


def _from_json(value) -> dict[str, Evidence] | str:
    if isinstance(value, str):
        return value
    return {
        str(name): Evidence(str(kind), None if source is None else str(source), (int(a), int(b)))
        for name, (kind, source, (a, b)) in value.items()
    }


def _read_tests(path: Path, data: bytes) -> dict[str, Evidence] | str:
    try:
        tree = ast.parse(data.decode("utf-8"), filename=str(path))
    except UnicodeDecodeError:
        return "not UTF-8 text"  # no file name: the parse cache keeps this by content, for any file
    except SyntaxError as exc:
        return f"not valid Python (line {exc.lineno})"
    module_marks = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
    ]

    def evidence(test: ast.FunctionDef | ast.AsyncFunctionDef, *decorator_lists: list[ast.expr]) -> Evidence:
        lines = (min([test.lineno, *(d.lineno for d in test.decorator_list)]), test.end_lineno)
        for decorators in (*decorator_lists, module_marks):
            source = _upstream_source(decorators)
            if source is not False:
                return Evidence("upstream", source, lines)
        return Evidence("reference", lines=lines)

    found: dict[str, Evidence] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = evidence(node, node.decorator_list)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}::{item.name}"] = evidence(item, item.decorator_list, node.decorator_list)
    return found


def _test_file(root: Path, path: str) -> Path | str:
    """The file `path` names under root/tests, or why it is not one there. Never through a symlink: a
    branch's `tests/x.py -> ~/.ssh/id_rsa` would be read by `check` and shown on the site."""
    if not path.startswith("tests/") or "\0" in path or ".." in path.split("/"):  # a NUL names no file
        return f"test file {path!r} does not exist under tests/"
    file = root / path
    linked = next((p for p in [file, *file.parents] if p != root and p.is_relative_to(root) and p.is_symlink()), None)
    if linked is not None:
        return f"test file {path!r}: {linked.relative_to(root)} is a symlink; tests are read from plain files only"
    return file if file.is_file() else f"test file {path!r} does not exist under tests/"


def evidence_of(context: Context, node_id: str) -> Evidence | str:
    """The evidence of the test `node_id` (pytest's `tests/PATH.py::[Class::]name[params]`), or why it names
    no test in the checkout (one line)."""
    root, parsed = context.root, context.parsed
    path, sep, name = node_id.partition("::")
    if not sep or not name:
        return f"{node_id!r} is not a pytest node id (tests/FILE.py::test_name)"
    file = (
        parsed.for_this_run(("test file", root, path), lambda: _test_file(root, path))
        if parsed
        else _test_file(root, path)
    )
    if isinstance(file, str):
        return file
    tests = _tests_in(file, context)
    if isinstance(tests, str):
        return f"{path}: {tests}"
    found = tests.get(name.split("[", 1)[0])
    return found or f"{path} has no test {name.split('[', 1)[0]}"


def missing_test(context: Context, node_id: str) -> str | None:
    """Why `node_id` names no test in the checkout, or None."""
    found = evidence_of(context, node_id)
    return found if isinstance(found, str) else None

"""`verified_by("tests/x.py::test_y")`: a note's claim names the test that demonstrates it; the test must exist."""
from __future__ import annotations

import ast
import functools
from pathlib import Path


@functools.cache
def _test_names(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{item.name}" for item in node.body
                      if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return frozenset(names)


def missing_test(root: Path, node_id: str) -> str | None:
    """Why `node_id` (pytest's `path::[Class::]name[params]`) names no test in the project, or None."""
    path, sep, name = node_id.partition("::")
    if not sep or not name:
        return f"{node_id!r} is not a pytest node id (tests/FILE.py::test_name)"
    file = root / path
    if not file.is_file() or not path.startswith("tests/"):
        return f"test file {path} does not exist"
    if name.split("[", 1)[0] not in _test_names(file):
        return f"{path} has no test {name.split('[', 1)[0]}"
    return None

"""Mechanisms never measure themselves: no module of the reference outside `reference/measure/` imports that
package, directly or through another module, except the demos, which attach its observers to a run. Read from
the import statements (AST), at module and function level, without importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MEASURE = "reference.measure"
# the demos: they wire observers in
ENTRY_POINTS = {
    "reference.__main__",
    "reference.gpt.demo",
    "reference.fsdp.demo",
    "reference.moe.demo",
    "reference.hf_tp.__main__",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every reference module an import statement in the file names (`from a import b` names a and a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] == "reference"}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in (ROOT / "reference").rglob("*.py")}


def is_measure(name: str) -> bool:
    return name == MEASURE or name.startswith(MEASURE + ".")


def measuring_path(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    """An import chain from `start` to reference.measure, through non-entry-point modules, or None."""
    seen, stack = {start}, [[start]]
    while stack:
        path = stack.pop()
        for name in sorted(edges.get(path[-1], ())):
            if is_measure(name):
                return [*path, name]
            # `from reference.x import y` names reference.x.y, which may be a module or an attribute
            if name in edges and name not in seen and name not in ENTRY_POINTS:
                seen.add(name)
                stack.append([*path, name])
    return None


def test_no_mechanism_imports_the_measuring_package():
    edges = graph()
    mechanisms = sorted(n for n in edges if not is_measure(n) and n not in ENTRY_POINTS)
    assert {"reference.pipeline.schedules", "reference.fsdp.runtime", "reference.gpt.train"} <= set(mechanisms)
    chains = [path for path in (measuring_path(m, edges) for m in mechanisms) if path]
    assert chains == [], "mechanisms importing reference.measure: " + "; ".join(" -> ".join(c) for c in chains)


def test_the_check_sees_an_import_of_the_measuring_package(tmp_path):
    """The check can fail: a function-level import of the recorder, two modules away, is found."""
    (tmp_path / "a.py").write_text("import reference.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from reference.measure.recorder import CollectiveRecorder\n")
    edges = {"reference.a": imports(tmp_path / "a.py"), "reference.b": imports(tmp_path / "b.py")}
    assert measuring_path("reference.a", edges) == [
        "reference.a",
        "reference.b",
        "reference.measure.recorder",
    ]

"""The citation tool's imports run one way: no module of tools/pin_and_cite or of the study package that registers
with it (tools/study) imports, at module or function level, one that imports it back (directly or around a
cycle), none imports the reference or torch, pin_and_cite never imports the study, and none of pin_and_cite
imports a layer above its own (core < relocation < site < the commands: the folders of tools/pin_and_cite); and
`check` on the shipped notes loads neither the reference nor torch (the Scale page's tables read the committed
traces instead). And pin_and_cite names no parallelism nor upstream project: it could ship alone."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

from tests.tools.conftest import ROOT

PACKAGE = ROOT / "tools" / "pin_and_cite"
STUDY = ROOT / "tools" / "study"
FORBIDDEN = ("reference", "torch")


def module_name(path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path) -> set[str]:
    """Every module an import statement anywhere in the file names (`from a import b` names a and a.b)."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def import_graph() -> dict[str, set[str]]:
    """{module: the pin_and_cite and study modules it imports}, plus FORBIDDEN roots where it imports those."""
    files = {module_name(p): p for package in (PACKAGE, STUDY) for p in package.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        names = imported_names(path)
        graph[name] = {n for n in names if n in files and n != name} | {
            n.split(".")[0] for n in names if n.split(".")[0] in FORBIDDEN
        }
    return graph


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_the_citation_tool():
    graph = import_graph()
    assert len(graph) > 30 and "pin_and_cite.cli" in graph and "study.plugin" in graph
    assert cycle_in(graph) is None, " -> ".join(cycle_in(graph))


def test_the_cycle_finder_finds_function_level_cycles():
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None


def test_no_module_of_the_citation_tool_imports_the_reference_or_torch():
    offenders = {name: sorted(deps & set(FORBIDDEN)) for name, deps in import_graph().items() if deps & set(FORBIDDEN)}
    assert offenders == {}


def test_the_citation_tool_never_imports_the_study():
    graph = import_graph()
    assert "study.note_rules" in graph["study.plugin"]  # the graph sees the study's own imports
    upward = [f"{m} -> {dep}" for m, deps in graph.items() if m.startswith("pin_and_cite") for dep in deps]
    assert [edge for edge in upward if edge.split(" -> ")[1].startswith("study")] == []


PARALLELISM_OR_UPSTREAM = re.compile(r"moe|fsdp|megatron|pipeline", re.IGNORECASE)


def test_no_module_of_the_citation_tool_names_a_parallelism_or_an_upstream_project():
    """Such facts are data (reading_notes/pins.toml) or the study's (tools/study): the tool could ship alone."""
    naming = sorted(
        str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if PARALLELISM_OR_UPSTREAM.search(p.read_text())
    )
    assert naming == []


def test_check_loads_neither_torch_nor_the_reference():
    """Run `check` on the shipped notes in a fresh interpreter and look at what it loaded."""
    probe = (
        "import sys, runpy\nsys.argv = ['pin_and_cite', 'check']\n"
        "try:\n    runpy.run_module('pin_and_cite', run_name='__main__')\nexcept SystemExit as e:\n"
        "    code = e.code\nelse:\n    code = 0\n"
        "print(code, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'reference'}))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tools")}
    env.pop("PIN_AND_CITE_PROJECT", None)
    proc = subprocess.run(
        [sys.executable, "-P", "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.stdout.strip().splitlines()[-1] == "0 []", proc.stdout + proc.stderr


LAYERS = ("core", "relocation", "site")  # docs/architecture.md: each imports only from the ones before it


def layer_of(module: str) -> int:
    """The rank of a module's layer, from its folder: core, relocation, site; then the commands at the top
    (cli, check, __main__); the package's own __init__ (a docstring) sits with the core."""
    parts = module.split(".")
    if len(parts) == 1:
        return 0
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else len(LAYERS)


def test_each_layer_imports_only_the_layers_below_it():
    graph = {module: deps for module, deps in import_graph().items() if module.startswith("pin_and_cite")}
    assert {layer_of(module) for module in graph} == {0, 1, 2, 3}
    upward = [
        f"{module} -> {dep}"
        for module, deps in graph.items()
        for dep in deps
        if dep.startswith("pin_and_cite") and layer_of(dep) > layer_of(module)
    ]
    assert upward == []

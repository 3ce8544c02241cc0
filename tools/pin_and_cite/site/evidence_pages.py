"""A page per test file whose tests a note names with `verified_by()`: each cited test's source, numbered with
its lines in the test file, with the kind of evidence it is and the pages that cite it, in the file's order.
Generated at every build from the test file in the working tree (pin_and_cite.core.verified_by finds the test),
never committed; the evidence line under a claim links to the test's section here (pin_and_cite.site.render),
so a reader sees what the test checks next to the file's other cited tests. Below them, the file's functions the
tests reach (found by AST, never imported), each linked from its callers: an upstream test's assertions read
records that a helper made by building and running the upstream code, and that helper is the evidence too.
One page per file, not per test: ninety-odd pages cost about 0.4 s of theme rendering in every site build.
The pages hide the side navigation and the table of contents: a test file's 120 columns then fit at 1280 px.
"""

from __future__ import annotations

import ast
import functools
import json
import posixpath
from pathlib import Path

from pin_and_cite.core.fences import fence_for
from pin_and_cite.core.verified_by import Evidence
from pin_and_cite.core.verified_cache import VerifiedCache, made_from

FOLDER = "tests"  # under the notes folder; mkdocs.yml keeps these pages out of the navigation
# name -> (the names of the file's other module-level definitions its body uses, its lines with decorators)
Helpers = dict[str, tuple[set[str], tuple[int, int]]]
KINDS = {
    "upstream": "upstream test: it runs the pinned upstream implementation itself ({source})",
    "reference": "reference test: it runs this kit's reference implementation (second evidence)",
}


def file_of(node_id: str) -> str:
    """tests/./reference/test_x.py::Class::test_y[param] -> tests/reference/test_x.py (one spelling per file)."""
    return posixpath.normpath(node_id.partition("::")[0])


def function_of(node_id: str) -> str:
    """tests/reference/test_x.py::Class::test_y[param] -> Class::test_y (every parameter shows the same source)."""
    return node_id.partition("::")[2].split("[", 1)[0]


def page_of(node_id: str) -> str:
    """tests/reference/test_x.py::Class::test_y[param] -> tests/reference/test_x.md"""
    return f"{FOLDER}/{file_of(node_id).removeprefix('tests/').removesuffix('.py')}.md"


def anchor_of(test_name: str) -> str:
    """Class::test_y -> Class.test_y: the id of the test's section on its file's page."""
    return test_name.replace("::", ".")


def link_from(page: str | None, node_id: str) -> str:
    """The relative Markdown link from the rendered page `page` (a path under the notes folder) to the test's
    section."""
    here = posixpath.dirname(page or "x.md")
    return f"{posixpath.relpath(page_of(node_id), here)}#{anchor_of(function_of(node_id))}"


def evidence_pages(
    root: Path, cited: dict[str, tuple[Evidence, list[str]]], cache_root: Path | None = None
) -> dict[str, str]:
    """Each test file's page (by path under the notes folder), from the cited tests: node id -> (evidence, the
    pages citing it). Left out of the search index (front matter `search: exclude`): source listings, found
    from the claims that cite them. Each file's helpers are kept under `cache_root` (when given) by its text."""
    helpers_of = _module_helpers if cache_root is None else functools.partial(_kept_helpers, cache_root)
    files: dict[str, dict[str, tuple[Evidence, list[str]]]] = {}
    for node_id, (evidence, citing) in cited.items():
        section = files.setdefault(file_of(node_id), {}).setdefault(function_of(node_id), (evidence, []))
        section[1].extend(page for page in citing if page not in section[1])
    return {page_of(path): _file_page(root, path, tests, helpers_of) for path, tests in files.items()}


def _file_page(root: Path, path: str, tests: dict[str, tuple[Evidence, list[str]]], helpers_of) -> str:
    here = page_of(path)
    text = (root / path).read_text(encoding="utf-8")
    lines = text.split("\n")
    helpers = helpers_of(text)
    parts = [
        f"---\nsearch:\n  exclude: true\nhide:\n  - navigation\n  - toc\n---\n\n# `{path}`\n\n"
        "The tests of this file that the notes cite, as in the working tree this site was built from, then the "
        "functions of the file they call (where an upstream test builds and runs the upstream code), each "
        "linked from its callers.\n"
    ]
    for name, (evidence, cited_by) in sorted(tests.items(), key=lambda item: item[1][0].lines):
        citing = ", ".join(
            f"[{page.removesuffix('.md')}]({posixpath.relpath(page, posixpath.dirname(here))})" for page in cited_by
        )
        parts.append(
            f"\n## `{name}` {{ #{anchor_of(name)} }}\n\n"
            f"**{KINDS[evidence.kind].format(source=evidence.source)}.**\n\n"
            f"L{evidence.lines[0]}–L{evidence.lines[1]}. Cited by: {citing}.{_calls(helpers, name)}\n\n"
            f"{_listing(lines, evidence.lines)}"
        )
    if called := _reached(helpers, tests):
        parts.append("\n## What the tests call\n")
        for helper in called:
            span = helpers[helper][1]
            parts.append(
                f"\n### `{helper}` {{ #{_helper_anchor(helper)} }}\n\n"
                f"L{span[0]}–L{span[1]}.{_calls(helpers, helper)}\n\n{_listing(lines, span)}"
            )
    return "".join(parts)


def _calls(helpers: Helpers, name: str) -> str:
    """` Calls: [a](#calls.a), [b](#calls.b).`: the file's functions `name` uses directly, in file order."""
    used = sorted(helpers.get(name, (set(), None))[0], key=lambda other: helpers[other][1])
    links = ", ".join(f"[`{other}`](#{_helper_anchor(other)})" for other in used)
    return f" Calls: {links}." if used else ""


def _reached(helpers: Helpers, tests: dict) -> list[str]:
    """The file's functions and classes the cited tests reach, directly or through one another, in file order."""
    reached: set[str] = set()
    todo = [name for test in tests for name in helpers.get(test, (set(), None))[0]]
    while todo:
        if (name := todo.pop()) not in reached:
            reached.add(name)
            todo += helpers[name][0]
    return sorted(reached, key=lambda name: helpers[name][1])


def _listing(lines: list[str], span: tuple[int, int]) -> str:
    first, last = span
    source = "".join(line + "\n" for line in lines[first - 1 : last])
    fence = fence_for(source)
    return f'{fence}python linenums="{first}"\n{source}{fence}\n'


def _helper_anchor(name: str) -> str:
    return f"calls.{name}"


def _kept_helpers(cache_root: Path, text: str) -> Helpers:
    """_module_helpers(text), parsed once per text: a pin_and_cite.core.verified_cache entry."""
    cache = VerifiedCache(cache_root, "test-helpers")
    made = made_from("test helpers", Path(__file__).read_text(), text)
    if (kept := cache.get(made)) is not None:
        try:
            return {str(name): ({str(u) for u in uses}, (int(a), int(b))) for name, (uses, (a, b)) in json.loads(kept)}
        except (ValueError, TypeError):  # not of this shape: parse again
            pass
    helpers = _module_helpers(text)
    cache.put(made, json.dumps([[name, [sorted(uses), list(span)]] for name, (uses, span) in helpers.items()]))
    return helpers


def _module_helpers(text: str) -> Helpers:
    """Every module-level function and class of a test file (tests excluded), with the module-level names its
    body uses. Read by AST, never imported; a file that does not parse has none (its tests' evidence says why)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return {}
    defined = {
        node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    tests = {name for name in defined if name.startswith(("test_", "Test"))}

    def uses(node: ast.AST) -> set[str]:
        body = node.body if isinstance(node, ast.ClassDef) else [*node.body, node.args]
        used = {n.id for part in body for n in ast.walk(part) if isinstance(n, ast.Name)}
        return used & (defined.keys() - tests - {getattr(node, "name", "")})

    helpers: Helpers = {
        name: (uses(node), (min([node.lineno, *(d.lineno for d in node.decorator_list)]), node.end_lineno))
        for name, node in defined.items()
        if name not in tests
    }
    for name in tests:  # the tests' own uses, under their names (a class's methods under Class::method)
        node = defined[name]
        helpers[name] = (uses(node), (0, 0))
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    helpers[f"{name}::{item.name}"] = (uses(item) | uses(node), (0, 0))
    return helpers

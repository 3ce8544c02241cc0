"""A page per test file whose tests a note names with `verified_by()`: each cited test's source, numbered with
its lines in the test file, with the kind of evidence it is and the pages that cite it, in the file's order.
Generated at every build from the test file in the working tree (pin_and_cite.core.verified_by finds the test),
never committed; the evidence line under a claim links to the test's section here (pin_and_cite.site.render),
so a reader sees what the test checks next to the file's other cited tests. One page per file, not per test:
ninety-odd pages cost about 0.4 s of theme rendering in every site build.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from pin_and_cite.core.fences import fence_for
from pin_and_cite.core.verified_by import Evidence

FOLDER = "tests"  # under the notes folder; mkdocs.yml keeps these pages out of the navigation
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


def evidence_pages(root: Path, cited: dict[str, tuple[Evidence, list[str]]]) -> dict[str, str]:
    """Each test file's page (by path under the notes folder), from the cited tests: node id -> (evidence, the
    pages citing it). Left out of the search index (front matter `search: exclude`): source listings, found
    from the claims that cite them."""
    files: dict[str, dict[str, tuple[Evidence, list[str]]]] = {}
    for node_id, (evidence, citing) in cited.items():
        section = files.setdefault(file_of(node_id), {}).setdefault(function_of(node_id), (evidence, []))
        section[1].extend(page for page in citing if page not in section[1])
    return {page_of(path): _file_page(root, path, tests) for path, tests in files.items()}


def _file_page(root: Path, path: str, tests: dict[str, tuple[Evidence, list[str]]]) -> str:
    here = page_of(path)
    lines = (root / path).read_text().split("\n")
    parts = [
        f"---\nsearch:\n  exclude: true\n---\n\n# `{path}`\n\n"
        "The tests of this file that the notes cite, as in the working tree this site was built from.\n"
    ]
    for name, (evidence, cited_by) in sorted(tests.items(), key=lambda item: item[1][0].lines):
        first, last = evidence.lines
        source = "".join(line + "\n" for line in lines[first - 1 : last])
        fence = fence_for(source)
        citing = ", ".join(
            f"[{page.removesuffix('.md')}]({posixpath.relpath(page, posixpath.dirname(here))})" for page in cited_by
        )
        parts.append(
            f"\n## `{name}` {{ #{anchor_of(name)} }}\n\n"
            f"**{KINDS[evidence.kind].format(source=evidence.source)}.**\n\n"
            f"L{first}–L{last}. Cited by: {citing}.\n\n"
            f'{fence}python linenums="{first}"\n{source}{fence}\n'
        )
    return "".join(parts)

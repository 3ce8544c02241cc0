"""A page per test a note names with `verified_by()`: the test's source, numbered with its lines in the test
file, with the kind of evidence it is and the pages that cite it. Generated at every build from the test file
in the working tree (pin_and_cite.core.verified_by finds the test), never committed; the evidence line under a
claim links here (pin_and_cite.site.render), so a reader sees what the test checks.
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


def page_of(node_id: str) -> str:
    """tests/reference/test_x.py::Class::test_y[param] -> tests/reference/test_x/Class.test_y.md"""
    path, _, name = node_id.partition("::")
    return f"{FOLDER}/{path.removeprefix('tests/').removesuffix('.py')}/{name.split('[', 1)[0].replace('::', '.')}.md"


def link_from(page: str | None, node_id: str) -> str:
    """The relative Markdown link from the rendered page `page` (a path under the notes folder) to the test's."""
    return posixpath.relpath(page_of(node_id), posixpath.dirname(page or "x.md"))


def evidence_page(root: Path, node_id: str, evidence: Evidence, cited_by: list[str]) -> str:
    """The test's page: what kind of evidence it is, where it lives, who cites it, and its source. Left out of
    the search index (front matter `search: exclude`): a source listing, found from the claim that cites it,
    and indexing ninety of them took most of a site build."""
    path = node_id.partition("::")[0]
    first, last = evidence.lines
    source = "".join(line + "\n" for line in (root / path).read_text().split("\n")[first - 1 : last])
    fence, here = fence_for(source), page_of(node_id)
    citing = ", ".join(
        f"[{page.removesuffix('.md')}]({posixpath.relpath(page, posixpath.dirname(here))})" for page in cited_by
    )
    return (
        "---\nsearch:\n  exclude: true\n---\n\n"
        f"# `{node_id.partition('::')[2]}`\n\n**{KINDS[evidence.kind].format(source=evidence.source)}.**\n\n"
        f"`{path}` L{first}–L{last}, as in the working tree this site was built from. Cited by: {citing}.\n\n"
        f'{fence}python linenums="{first}"\n{source}{fence}\n'
    )

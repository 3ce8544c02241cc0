"""Every reference module that mirrors upstream code has a page mapping it, and the mapping cannot go stale."""

from __future__ import annotations

import re

import pytest

from pin_and_cite.core.context import Context
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.local_code import definition
from pin_and_cite.core.parse_cache import ParseCache
from tests.tools.conftest import ROOT


def page_of(module: str):
    return (
        ROOT
        / "reading_notes"
        / "reference"
        / (module.removeprefix("reference/").removesuffix(".py").replace("/", ".") + ".md.j2")
    )


def test_every_reference_module_has_a_page():
    """A module that says what it mirrors ("Mirrors `SOURCE:PATH::Name`") has a page mapping it; one that mirrors
    nothing upstream (a demo, a measurement, the CLIs' plumbing) says so by not claiming to, and needs none."""
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "reference").rglob("*.py"))
    mirroring = [m for m in modules if not m.endswith("/__init__.py") and "Mirrors" in (ROOT / m).read_text()]
    assert len(mirroring) >= 40  # the walk found the reference's mechanisms
    missing = [m for m in mirroring if not page_of(m).is_file()]
    assert missing == [], "write reading_notes/reference/<module>.md.j2 for these"
    pages = sorted((ROOT / "reading_notes" / "reference").glob("*.md.j2"))
    orphans = [p.name for p in pages if not any(page_of(m) == p for m in modules)]
    assert orphans == [], "these pages map a module that no longer exists"


def test_ours_points_at_the_definition_and_refuses_a_stale_name(tmp_path):
    parsed = ParseCache(tmp_path)
    text = str(definition(Context(ROOT, parsed), "reference/tensor_parallel/mappings.py::_CopyToTensorParallelRegion"))
    first = next(
        i
        for i, line in enumerate((ROOT / "reference/tensor_parallel/mappings.py").read_text().split("\n"), 1)
        if line.startswith("class _CopyToTensorParallelRegion")
    )
    assert text.startswith(f"`_CopyToTensorParallelRegion` (reference/tensor_parallel/mappings.py L{first}–L")
    with pytest.raises(PinAndCiteError, match="symbol 'renamed' is not defined in reference/fsdp/runtime.py"):
        definition(Context(ROOT, parsed), "reference/fsdp/runtime.py::renamed")
    with pytest.raises(PinAndCiteError, match="does not exist"):
        definition(Context(ROOT, parsed), "reference/gone.py::x")


def test_a_reference_page_links_each_mapped_definition_to_its_code_shown_on_the_page():
    """Finding: reference pages showed a mapping table but neither the reference code nor a link to it. Each
    `ours()` in the table links to an anchor on the page, where the definition is shown with our file's line
    numbers, so the reader sees the reference beside the upstream lines it mirrors."""
    from pin_and_cite.core.project import Project
    from pin_and_cite.site.render import Renderer

    project = Project(ROOT)
    page = Renderer(project).render(project.notes_dir / "reference" / "data_parallel.buckets.md.j2")
    source = (ROOT / "reference/data_parallel/buckets.py").read_text().split("\n")
    links = re.findall(r"\| \[`([\w.]+)` \(reference/data_parallel/buckets\.py L(\d+)–L(\d+)\)\]\(#([\w-]+)\) \|", page)
    assert [name for name, *_ in links] == [
        "bucket_layout",
        "GradBucket.start_grad_sync",
        "GradBucket.finish_grad_sync",
    ]
    for _, first, last, anchor in links:
        assert page.count(f'id="{anchor}"') == 1
        shown = page.split(f'id="{anchor}"', 1)[1]
        fence = re.search(r'\n(`{3,})python linenums="(\d+)"\n', shown)
        assert fence and fence[2] == first
        code = shown[fence.end() :].split(f"\n{fence[1]}\n", 1)[0]
        assert code.split("\n") == source[int(first) - 1 : int(last)]

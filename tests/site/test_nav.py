"""The reading order: mkdocs.yml's `nav` is the one place it lives, and the home page prescribes the same order.

A note rendered but not listed in `nav` would fall to the bottom of the side navigation; these tests (and
`mkdocs build --strict`, through validation.nav.omitted_files) fail instead.
"""

from __future__ import annotations

import re
import shutil

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

from pin_and_cite.core.project import Project
from pin_and_cite.site.reading_order import MARKER, nav_pages, reading_order
from pin_and_cite.site.render import pages
from tests.site.conftest import ROOT


def mkdocs_nav() -> list:
    return load_config(config_file=str(ROOT / "mkdocs.yml")).nav


def listed(markdown: str) -> tuple[list[str], list[str]]:
    """The numbers of a generated reading order's items, and the pages it links, in order."""
    return re.findall(r"^(\d+)\. ", markdown, re.M), re.findall(r"\]\(([^)#]+\.md)\)", markdown)


def test_the_home_page_lists_every_page_in_the_nav_order_numbered_by_the_build():
    assert MARKER in (ROOT / "docs" / "index.md").read_text()  # the list is the hook's, never hand-kept
    nav = mkdocs_nav()
    numbers, links = listed(reading_order(nav, lambda path: (path, "")))
    assert links == nav_pages(nav)[1:] and links[:2] == ["notes/walkthrough-tp.md", "notes/megatron-tp-layers.md"]
    assert numbers == [str(n) for n in range(1, len(numbers) + 1)]
    assert nav.index({"Notes": nav[1]["Notes"]}) == 1 and len(numbers) < len(links)  # a section is one item
    # A note given a slot in nav takes it on the home page; the later items move down with no edit.
    notes = nav[1]["Notes"]
    slot = notes.index("notes/fsdp-prefetch.md") + 1  # the pages before it are single items, numbered from 1
    following = notes[slot]
    notes.insert(slot, "notes/new-note.md")
    after = reading_order(nav, lambda path: (path, ""))
    assert f"{slot + 1}. **[notes/new-note.md](notes/new-note.md)**\n" in after
    assert f"{slot + 2}. **[{following}]({following})**\n" in after


def test_the_built_home_page_shows_each_note_with_its_title_and_description(built_site):
    home = (built_site / "index.html").read_text()
    order = home.split('id="what-to-read-in-order"', 1)[1].split("</ol>", 1)[0]
    items = re.findall(r"<li>(.*?)</li>", order, re.S)
    assert items[0].startswith(
        '<strong><a href="notes/walkthrough-tp/">Tensor and sequence parallelism, walked through</a></strong>: start'
    )
    assert items[1].startswith(
        '<strong><a href="notes/megatron-tp-layers/">Megatron-LM tensor-parallel linears</a></strong>: a close'
    )
    assert "where the all-reduces really are" in items[1]
    hrefs = [re.search(r'href="([^"]+)"', item)[1] for item in items]
    urls = [page.removesuffix(".md") + "/" for page in nav_pages(mkdocs_nav())[1:]]
    nav = [url.removesuffix("index/") for url in urls]  # mkdocs serves a folder's index.md as the folder
    assert hrefs == [page for page in nav if page in hrefs]  # a section's first link stands for it
    assert MARKER not in home


def test_every_rendered_note_has_a_slot_in_the_nav():
    nav = set(nav_pages(mkdocs_nav()))
    rendered = {f"notes/{page}" for _, _, page in pages(Project(ROOT))}
    assert {"notes/scale.md", "notes/sources/pytorch.md", "notes/reference/fsdp.runtime.md"} <= rendered
    assert sorted(rendered - nav) == []


def test_a_note_missing_from_the_nav_fails_the_strict_build(vendored_docs, tmp_path, caplog):
    docs = tmp_path / "docs"
    shutil.copytree(vendored_docs, docs)
    config = load_config(
        config_file=str(ROOT / "mkdocs.yml"), docs_dir=str(docs), site_dir=str(tmp_path / "site"), strict=True
    )
    config.nav = [{"Home": "index.md"}, {"Notes": ["notes/megatron-tp-layers.md"]}]
    with pytest.raises(Abort):
        build(config)
    omitted = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "notes/fsdp-prefetch.md" in omitted and "notes/reference/fsdp.runtime.md" in omitted


MENU_CHARS = 24  # one line of the side menu at 1280 px ("distributed_optimizer.py", seen in a screenshot)


def test_reference_module_entries_differ_within_what_the_side_menu_shows():
    """Finding: seven entries showed as the same 'reference/data_parallel...'. Each entry's label (its nav label,
    else its page's title) names the file first, so its first line tells them apart."""
    notes = mkdocs_nav()[1]["Notes"]
    section = next(i["Reference modules"] for i in notes if isinstance(i, dict) and "Reference modules" in i)

    def shown(item) -> str:
        if isinstance(item, dict):
            return next(iter(item))
        template = ROOT / "reading_notes" / (item.removeprefix("notes/") + ".j2")
        return next(line[2:] for line in template.read_text().split("\n") if line.startswith("# "))

    labels = [shown(item)[:MENU_CHARS] for item in section]
    assert len(labels) > 20 and len(set(labels)) == len(labels), sorted(labels)

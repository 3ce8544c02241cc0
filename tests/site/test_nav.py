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
from pin_and_cite.site.render import pages
from tests.site.conftest import ROOT

READING_ORDER = "## What to read, in order"


def nav_pages(nav) -> list[str]:
    """The page paths of a mkdocs `nav`, depth first, in order."""
    found = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        found += nav_pages(value) if isinstance(value, list) else [value]
    return found


def home_reading_order() -> list[str]:
    """The pages the home page's "What to read, in order" links to, first mention of each, in order."""
    text = (ROOT / "docs" / "index.md").read_text()
    section = text.split(READING_ORDER, 1)[1].split("\n## ", 1)[0]
    return list(dict.fromkeys(re.findall(r"\]\(([^)#]+\.md)\)", section)))


def test_home_page_lists_the_notes_in_the_nav_order():
    nav = nav_pages(load_config(config_file=str(ROOT / "mkdocs.yml")).nav)
    home = home_reading_order()
    assert len(home) >= 10 and home[0] == "notes/megatron-tp-layers.md"
    assert [page for page in nav if page in home] == home
    assert nav.index("notes/fsdp-prefetch.md") < nav.index("notes/megatron-pipeline-1f1b.md")


def test_every_rendered_note_has_a_slot_in_the_nav():
    nav = set(nav_pages(load_config(config_file=str(ROOT / "mkdocs.yml")).nav))
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

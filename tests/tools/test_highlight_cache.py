"""The highlight cache (pin_and_cite.site.highlight_cache) keeps each code block's HTML between builds and can
never change what a page publishes: a planted or damaged entry is highlighted afresh."""

import json

import markdown
import pytest
from pymdownx.highlight import Highlight

from pin_and_cite.site import highlight_cache

EXTENSIONS = ["pymdownx.highlight", "pymdownx.superfences", "pymdownx.inlinehilite"]
CONFIG = {"pymdownx.highlight": {"anchor_linenums": True, "line_spans": "__span", "pygments_lang_class": True}}
PAGE = '```python linenums="954" hl_lines="2"\ndef f(x):\n    return x + 1\n```\n\nand `#!python x = 1` inline\n'


def _html() -> str:
    return markdown.markdown(PAGE, extensions=EXTENSIONS, extension_configs=CONFIG)


@pytest.fixture
def installed(monkeypatch, tmp_path):
    monkeypatch.setattr(Highlight, "highlight", Highlight.highlight)  # put back after the test
    uncached = _html()
    highlight_cache.install(tmp_path)
    return uncached, tmp_path


def test_a_block_is_kept_and_read_back_the_same(installed):
    uncached, cache = installed
    assert _html() == uncached
    [entry] = list((cache / "highlighted").rglob("*.json"))  # the block; the inline span is not kept
    assert "linenos" in json.loads(entry.read_bytes())["text"]
    highlight_cache.install(cache)  # a new build: read from disk
    assert _html() == uncached


@pytest.mark.parametrize("damage", ["script", "garbage"])
def test_a_planted_block_changes_nothing(installed, damage):
    uncached, cache = installed
    _html()
    [entry] = list((cache / "highlighted").rglob("*.json"))
    stored = json.loads(entry.read_bytes())
    planted = json.dumps({**stored, "text": "<script>alert(1)</script>"}).encode()
    entry.write_bytes(planted if damage == "script" else b"\xff{")
    highlight_cache.install(cache)
    assert _html() == uncached
    assert json.loads(entry.read_bytes()) == stored  # highlighted afresh and written again

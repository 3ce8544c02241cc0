"""The page HTML mkdocs-material's search plugin reads: the same text, without the code blocks' markup that the
index never keeps.

Material's search indexes a page by feeding its HTML to an html.parser subclass, which keeps the text of every
element and a few tags (p, code, pre, lists) and drops the rest. In a code block Pygments wraps nearly every
token in a <span>, and numbered excerpts give every line an empty <a> anchor and a linked number in the
line-number column, so the notes' code blocks were most of the tags that parser visited, and indexing about a
fifth of a `mkdocs build`. Inside <pre> a span contributes no tag to the index, only its text, and an empty <a>
nothing at all; the line-number column (`<div class="linenodiv">`) the parser skips whole. So removing those
tags, and the column's numbers, leaves the index as it was (tests/site/test_build.py compares material's own
parser on every page of the built site, with and without them).
"""

from __future__ import annotations

import re

_PRE_BLOCK = re.compile(r"<pre\b.*?</pre>", re.S)
_UNINDEXED_TAG = re.compile(r"</?span\b[^>]*>|<a\b[^>]*></a>")  # a span tag; an anchor with nothing inside
_LINE_NUMBERS = '<div class="linenodiv">'  # Pygments' line-number column, which material's parser skips


def _bare(block: re.Match) -> str:
    if block.string.endswith(_LINE_NUMBERS, 0, block.start()):
        return block[0][: block[0].index(">") + 1] + "</pre>"
    return _UNINDEXED_TAG.sub("", block[0])


def without_code_spans(html: str) -> str:
    """`html` with, inside each <pre> block, every <span> and </span> tag and every empty <a></a> removed (their
    text stays), and the line-number column's <pre> emptied."""
    return _PRE_BLOCK.sub(_bare, html)

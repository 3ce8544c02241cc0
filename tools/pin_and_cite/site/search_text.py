"""The page HTML mkdocs-material's search plugin reads: the same text, without the highlighter's spans.

Material's search indexes a page by feeding its HTML to an html.parser subclass, which keeps the text of every
element and a few tags (p, code, pre, lists) and drops the rest. In a code block Pygments wraps nearly every
token, and numbered excerpts every line, in a <span>, so the notes' code blocks were most of the tags that
parser visited, and indexing about a fifth of a `mkdocs build`. A span inside <pre> contributes no tag to the
index, only its text, so removing the span tags there leaves the index as it was (tests/site/test_build.py
compares material's own parser on every page of the built site, with and without them).
"""

from __future__ import annotations

import re

_PRE_BLOCK = re.compile(r"<pre\b.*?</pre>", re.S)
_SPAN_TAG = re.compile(r"</?span\b[^>]*>")


def without_code_spans(html: str) -> str:
    """`html` with every <span> and </span> tag inside a <pre> block removed; their text stays."""
    return _PRE_BLOCK.sub(lambda block: _SPAN_TAG.sub("", block[0]), html)

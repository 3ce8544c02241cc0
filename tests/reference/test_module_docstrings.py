"""Module docstrings say what the module is and what it mirrors, in about 120 words; the depth lives on the
site (the reference-module pages, docs/reference-guide.md), where a reader looks for it and it is said once."""

from __future__ import annotations

import ast

from tests.launch import ROOT

MOST_WORDS = 130  # "about 120 words": a few over is a sentence's wrap, not a second essay


def docstring_words() -> dict[str, int]:
    """Words in each reference module's docstring (0 when it has none), as `str.split` counts them."""
    words = {}
    for path in sorted((ROOT / "reference").rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        words[path.relative_to(ROOT).as_posix()] = len(docstring.split())
    return words


def test_every_module_docstring_is_at_most_about_120_words():
    words = docstring_words()
    assert len(words) >= 50 and max(words.values()) > 0  # the walk found the reference and its docstrings
    too_long = {path: n for path, n in words.items() if n > MOST_WORDS}
    assert too_long == {}, "say what the module is and mirrors; move the depth to its page on the site"

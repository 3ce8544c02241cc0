"""Highlight each code block once per change: Pygments is a third of a `mkdocs build` (the site shows whole
excerpts, test files and reference code, 800 blocks), and a block's HTML depends only on its text, the
fence's options, the highlighter's settings and the versions of the code that makes it.

install() wraps pymdownx's Highlight.highlight for the build's process: the HTML of a block (not an inline
span, and not one whose title the highlighter stashes in the page) is a pin_and_cite.core.verified_cache entry,
since it is published as it is: used only when made from the very block being highlighted, under this user's
key. `mkdocs serve` keeps them in memory too, so a reload highlights only what changed.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from pin_and_cite.core.verified_cache import VerifiedCache, made_from


@functools.cache
def _versions() -> str:
    import pygments
    import pymdownx.__meta__

    return json.dumps([pygments.__version__, pymdownx.__meta__.__version__, Path(__file__).read_bytes().hex()])


def _settings(highlighter) -> str:
    """The highlighter's settings (all but its Markdown instance), as text."""
    return json.dumps({k: v for k, v in vars(highlighter).items() if k != "md"}, sort_keys=True, default=repr)


def install(cache_root: Path) -> None:
    """From now on, in this process, block highlights are kept under `cache_root`/highlighted."""
    from pymdownx.highlight import Highlight

    highlight = getattr(Highlight.highlight, "uncached", Highlight.highlight)
    cache, memo = VerifiedCache(cache_root, "highlighted"), {}

    @functools.wraps(highlight)
    def cached(self, src, language, *args, **kwargs):
        if kwargs.get("inline") or kwargs.get("title") or self.auto_title or len(args) > 4:
            return highlight(self, src, language, *args, **kwargs)  # an element, or a title stashed in the page
        options = json.dumps([args, kwargs], default=repr)
        made = made_from("highlight", _versions(), _settings(self), src, language, options)
        if made not in memo:
            if (html := cache.get(made)) is None:
                html = highlight(self, src, language, *args, **kwargs)
                cache.put(made, html)
            memo[made] = html
        return memo[made]

    cached.uncached = highlight
    Highlight.highlight = cached

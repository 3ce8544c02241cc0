"""Convert each page's Markdown once per change: Python-Markdown is the largest part of a `mkdocs build` (1.5 s
of 3.5 s, spread over the site's 120 pages), and what a conversion gives depends only on the page's Markdown,
its place among the site's files (its links are rewritten and checked against them), the Markdown settings
and the versions of the code that converts it.

install() wraps mkdocs' Page.render for the build's process: what it sets (the HTML, the table of contents,
the title found in it, the anchors the page holds and its links to anchors elsewhere) is a
pin_and_cite.core.verified_cache entry, since the HTML is published as it is: used only when made from the
very Markdown being converted, under this user's key. A page whose conversion logged anything (a broken link)
is converted afresh every build, so each build says it again and `mkdocs build --strict` still fails on it.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

from pin_and_cite.core.compiled_templates import qualname
from pin_and_cite.core.verified_cache import VerifiedCache, made_from


@functools.cache
def _versions() -> str:
    import markdown
    import mkdocs
    import pygments
    import pymdownx.__meta__

    versions = [mkdocs.__version__, markdown.__version__, pymdownx.__meta__.__version__, pygments.__version__]
    return json.dumps([*versions, Path(__file__).read_bytes().hex()])


def _settings(config) -> str:
    keys = ("markdown_extensions", "mdx_configs", "use_directory_urls", "validation")
    return json.dumps([config[key] for key in keys], default=qualname, sort_keys=True)


def _site(files) -> str:
    """The site's files as links see them, once per build (kept on the build's Files)."""
    if not hasattr(files, "_pin_and_cite_site"):
        places = sorted((f.src_uri, f.dest_uri, f.url, str(f.inclusion)) for f in files)
        files._pin_and_cite_site = made_from(json.dumps(places))
    return files._pin_and_cite_site


class _Logged(logging.Handler):
    """Whether mkdocs logged anything (INFO and up) while a page converted."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record):
        self.count += 1


def _token(anchor) -> dict:
    """A table of contents entry as the toc extension's token that mkdocs made it from (mkdocs.structure.toc)."""
    return {
        "level": anchor.level,
        "id": anchor.id,
        "name": anchor.title,
        "children": [_token(a) for a in anchor.children],
    }


def install(cache_root: Path) -> None:
    """From now on, in this process, pages convert through the cache under `cache_root`/html."""
    from mkdocs.structure.pages import Page
    from mkdocs.structure.toc import get_toc

    render = getattr(Page.render, "uncached", Page.render)
    cache, memo = VerifiedCache(cache_root, "html"), {}

    @functools.wraps(render)
    def cached(self, config, files):
        if self.markdown is None:
            return render(self, config, files)
        made = made_from("page html", _versions(), _settings(config), _site(files), self.file.src_uri, self.markdown)
        kept = memo.get(made) or cache.get(made)
        if kept is not None:
            entry = json.loads(kept)
            linked = {files.get_file_from_path(uri): links for uri, links in entry["links_to_anchors"].items()}
            if None not in linked:
                self.content, self.toc = entry["content"], get_toc(entry["toc"])
                self._title_from_render, self.present_anchor_ids = entry["title"], set(entry["anchors"])
                self.links_to_anchors = linked
                memo[made] = kept
                return
        logged, mkdocs_log = _Logged(), logging.getLogger("mkdocs")
        mkdocs_log.addHandler(logged)
        try:
            render(self, config, files)
        finally:
            mkdocs_log.removeHandler(logged)
        if logged.count:
            return
        entry = {
            "content": self.content,
            "toc": [_token(anchor) for anchor in self.toc],
            "title": self._title_from_render,
            "anchors": sorted(self.present_anchor_ids or ()),
            "links_to_anchors": {f.src_uri: links for f, links in (self.links_to_anchors or {}).items()},
        }
        memo[made] = kept = json.dumps(entry)
        cache.put(made, kept)

    cached.uncached = render
    Page.render = cached

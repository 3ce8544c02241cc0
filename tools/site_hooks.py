"""mkdocs hooks (mkdocs.yml `hooks:`): the steps every site build needs before mkdocs reads docs/.

`on_pre_build` runs before `mkdocs build` and before every live-reload rebuild of `mkdocs serve`:
  1. The self-hosted mermaid must be installed and match its pin. Without it mkdocs-material would
     quietly load mermaid from unpkg.com, so a missing or altered file stops the build with one line
     saying how to fix it (`tools/vendor-assets`, which `make serve` and the site tests run).
  2. The reading-note templates are rendered into `<docs_dir>/notes/` by pin_and_cite.site.render (with the helpers
     of the plugin reading_notes/pins.toml names: this study's, tools/study/plugin.py), which leaves unchanged
     outputs untouched (mkdocs watches docs/, so rewriting a file on every build would trigger the next rebuild
     forever) and, on a bad template, stops `mkdocs build` with the template's file:line and leaves the previous
     page as it was; under `mkdocs serve` that line is logged and the site goes on serving (after a `bump`, the
     change pages say what to fix). It renders holding the project's write lock, as `tools/pin-and-cite render`
     does, and refuses a bump's interrupted write (its journal) in one line naming the verb that finishes it.
`on_config` keeps each page's converted HTML, verified, under the user's cache (pin_and_cite.site.html_cache):
Python-Markdown was the largest part of a build; and each code block's highlighted HTML, for the pages that do
convert (pin_and_cite.site.highlight_cache); `on_env` keeps the theme's compiled templates there too
(pin_and_cite.core.compiled_templates).
`on_page_context`, around mkdocs-material's search plugin (which indexes `page.content` at the default
priority), hands it the page without the code blocks' span tags, line anchors and line numbers
(pin_and_cite.site.search_text: the same index, at a sixth of its cost) and gives the page its full HTML back
before the theme renders it.
`on_post_page` drops the mermaid script from a page that has no diagram: material loads mermaid only for a page
with diagrams (so no CDN request follows), and parsing its 3 MB took most of each other page's load. Every page
is a full load (no `navigation.instant`; tests/site/test_build.py keeps it off), so none inherits another's.
`on_page_markdown` writes the home page's reading order from `nav` (pin_and_cite.site.reading_order).
`on_serve` watches reading_notes/ as well, so saving a template re-renders and reloads the page.
The project root is $PIN_AND_CITE_PROJECT when set (tests build scratch copies), else the folder of mkdocs.yml.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path

import vendor_assets
from mkdocs.exceptions import PluginError
from mkdocs.plugins import CombinedEvent, event_priority
from mkdocs.utils.meta import get_data

from pin_and_cite.core.compiled_templates import CompiledTemplates
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.project import NOTES_DIR
from pin_and_cite.core.store import default_cache_dir, refuse_cache_inside
from pin_and_cite.core.write_lock import write_lock
from pin_and_cite.relocation import journal
from pin_and_cite.site import highlight_cache, html_cache
from pin_and_cite.site.reading_order import MARKER, reading_order
from pin_and_cite.site.render import render_notes
from pin_and_cite.site.search_text import without_code_spans


def project_root(config) -> Path:
    """$PIN_AND_CITE_PROJECT (as for the CLI), else the folder holding mkdocs.yml: tests build scratch copies."""
    return Path(os.environ.get("PIN_AND_CITE_PROJECT") or Path(config.config_file_path).resolve().parent)


_cache: Path | None = None  # the user's cache, once on_config found it outside the project
_serving = False  # `mkdocs serve`, not `build`: a broken note is logged and the site keeps serving
log = logging.getLogger("mkdocs.hooks.pin_and_cite")


def on_startup(command: str, dirty: bool) -> None:
    global _serving
    _serving = command == "serve"


def on_config(config):
    try:
        cache = default_cache_dir()
        refuse_cache_inside(cache, project_root(config), "the project")
    except PinAndCiteError:  # on_pre_build's render says so, in one line
        return config
    highlight_cache.install(cache)
    html_cache.install(cache)
    global _cache
    _cache = cache
    return config


def on_env(env, config, files):
    if _cache is not None:
        env.loader = CompiledTemplates(env.loader, _cache)
    return env


def on_pre_build(config) -> None:
    docs_dir = Path(config.docs_dir)
    try:
        found = vendor_assets.problems(docs_dir, vendor_assets.load_lock())
    except vendor_assets.AssetError as e:
        raise PluginError(str(e)) from None
    if found:
        raise PluginError(f"{found[0]}; run tools/vendor-assets --docs-dir {docs_dir} (make serve does)")
    root = project_root(config)
    try:
        with write_lock(root):  # as `tools/pin-and-cite render` holds it: a bump writing now finishes first
            journal.refuse_pending(root / NOTES_DIR, "mkdocs build")  # a bump killed mid-write is not rendered
            render_notes(root, docs_dir / "notes")
    except PinAndCiteError as e:
        if not _serving:
            raise PluginError(str(e)) from None
        log.error(str(e))  # render wrote the other pages; the broken one stays as it was until mended


def _title_and_description(docs_dir: Path, path: str) -> tuple[str, str]:
    """A page's title (its front matter's, else its first `# ` heading) and its front matter's description; a
    page `nav` names but docs/ lacks (mkdocs warns of it) is listed by its path."""
    if not (docs_dir / path).is_file():
        return path, ""
    text, meta = get_data((docs_dir / path).read_text(encoding="utf-8"))
    heading = next((line[2:].strip() for line in text.split("\n") if line.startswith("# ")), path)
    return str(meta.get("title") or heading), " ".join(str(meta.get("description", "")).split())


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md" or MARKER not in markdown:
        return markdown
    docs_dir = Path(config.docs_dir)
    return markdown.replace(MARKER, reading_order(config.nav, lambda path: _title_and_description(docs_dir, path)))


_full_html: dict[int, str] = {}  # id(page) -> page.content, while the search plugin reads the short form


@event_priority(100)
def _before_search(context, page, config, nav):
    if "data-search-" not in page.content:  # material edits such attributes out of page.content: leave it so
        _full_html[id(page)] = page.content
        page.content = without_code_spans(page.content)
    return context


@event_priority(-100)
def _after_search(context, page, config, nav):
    if id(page) in _full_html:
        page.content = _full_html.pop(id(page))
    return context


on_page_context = CombinedEvent(_before_search, _after_search)


@functools.cache
def _mermaid_script() -> re.Pattern:
    """The script tag mkdocs writes for the vendored mermaid (its path from tools/vendor-assets.lock)."""
    (dest,) = [asset.dest for asset in vendor_assets.load_lock() if asset.name == "mermaid"]
    return re.compile(rf'<script src="(?:\.\./)*{re.escape(dest)}"></script>\n?')


def on_post_page(output: str, page, config) -> str:
    return output if '<pre class="mermaid">' in output else _mermaid_script().sub("", output, count=1)


def on_serve(server, config, builder):
    templates = project_root(config) / "reading_notes"
    if templates.is_dir():
        server.watch(str(templates))
    return server

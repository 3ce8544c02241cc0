"""The home page's "What to read, in order", generated from mkdocs.yml `nav` at every build.

The order lives in one place: a note added to `nav` appears on the home page in its slot, numbered, and no item
is renumbered by hand. Each page of a top-level section (Notes) is an item with its title and its front
matter's `description`; a nested section (Reference modules) is one item linking each of its pages, or, when
it holds one page, that page's item; the site's other pages follow. The mkdocs hook (tools/site_hooks.py)
replaces MARKER with the list.
"""

from __future__ import annotations

from collections.abc import Callable

MARKER = "<!-- reading order: generated from mkdocs.yml nav (pin_and_cite/site/reading_order.py) -->"
PageInfo = Callable[[str], tuple[str, str]]  # a page's path -> (title, description)


def nav_pages(nav: list) -> list[str]:
    """The page paths of a mkdocs `nav`, depth first, in order."""
    found = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        found += nav_pages(value) if isinstance(value, list) else [value]
    return found


def _entries(nav: list) -> list[tuple[str | None, str | list]]:
    """(label, path or sub-nav) per nav item."""
    return [next(iter(item.items())) if isinstance(item, dict) else (None, item) for item in nav]


def _page_item(label: str | None, path: str, info: PageInfo) -> str:
    title, description = info(path)
    return f"**[{label or title}]({path})**" + (f": {description}" if description else "")


def reading_order(nav: list, info: PageInfo) -> str:
    """The numbered Markdown list of every page in `nav` but the first (the home page itself)."""
    items = []
    for label, value in _entries(nav)[1:]:
        if not isinstance(value, list):
            items.append(_page_item(label, value, info))
            continue
        for sub_label, sub_value in _entries(value):
            if isinstance(sub_value, list) and len(nav_pages(sub_value)) == 1:  # a section for its index page
                items.append(_page_item(sub_label, nav_pages(sub_value)[0], info))
            elif isinstance(sub_value, list):
                links = ", ".join(f"[{info(path)[0]}]({path})" for path in nav_pages(sub_value))
                items.append(f"**{sub_label}**: {links}")
            else:
                items.append(_page_item(sub_label, sub_value, info))
    return "\n".join(f"{n}. {item}" for n, item in enumerate(items, 1)) + "\n"

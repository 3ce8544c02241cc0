"""Find URLs in built site files that a browser would fetch from a host other than this machine.

A static complement to the browser test: it sees every file, including code paths a page load does not
take. It tells fetches from mere text: in HTML only attributes that load something count (script src,
link href, img src/srcset, ...), never <a href>; in CSS `url()` and `@import`; in JS a string literal that
*is* a URL (starts with it), not prose that mentions one ("please report this at https://...").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# XML namespace names are identifiers that only look like URLs; nothing ever fetches them.
XML_NAMESPACES = {
    "http://www.w3.org/2000/svg",
    "http://www.w3.org/1999/xhtml",
    "http://www.w3.org/1999/xlink",
    "http://www.w3.org/1998/Math/MathML",
    "http://www.w3.org/XML/1998/namespace",
    "http://www.w3.org/2000/xmlns/",
}
# (tag, attribute) pairs whose URL the browser loads by itself. <a href> and <form action> are navigation.
FETCHING_ATTRS = {
    ("script", "src"),
    ("link", "href"),
    ("img", "src"),
    ("img", "srcset"),
    ("source", "src"),
    ("source", "srcset"),
    ("iframe", "src"),
    ("embed", "src"),
    ("object", "data"),
    ("video", "src"),
    ("video", "poster"),
    ("audio", "src"),
    ("track", "src"),
    ("input", "src"),
    ("image", "href"),
    ("use", "href"),
}
NOT_FETCHED_LINK_RELS = {"canonical", "alternate", "author", "license", "help", "search", "next", "prev"}
CSS_URL = re.compile(r"""@import\s+["']([^"']+)["']|url\(\s*["']?([^"')\s]+)""", re.I)
JS_URL_LITERAL = re.compile(r"""["'`](https?://[^"'`\s]*)""")


@dataclass(frozen=True)
class ExternalRef:
    file: str  # relative to the scanned site dir
    how: str  # what would fetch it, e.g. "<script src>", "css url()", "js literal"
    url: str


def is_external(url: str) -> bool:
    """True for an absolute or protocol-relative URL whose host is not loopback."""
    if url.startswith("//"):
        url = "http:" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:  # a bare "https://" is a prefix test
        return False
    return parts.hostname not in LOOPBACK and url not in XML_NAMESPACES


def refs_in_css(text: str) -> list[tuple[str, str]]:
    return [("css url()/@import", a or b) for a, b in CSS_URL.findall(text)]


def refs_in_js(text: str) -> list[tuple[str, str]]:
    return [("js literal", url) for url in JS_URL_LITERAL.findall(text)]


class _HtmlRefs(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.refs: list[tuple[str, str]] = []
        self._in = None  # "style" or "script" while inside one, for inline code

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        rels = set((attrs.get("rel") or "").lower().split())
        for name, value in attrs.items():
            if value is None:
                continue
            if (tag, name) in FETCHING_ATTRS and not (tag == "link" and rels and rels <= NOT_FETCHED_LINK_RELS):
                urls = [part.split()[0] for part in value.split(",") if part.strip()] if "srcset" in name else [value]
                self.refs += [(f"<{tag} {name}>", url) for url in urls]
            elif name == "style":
                self.refs += refs_in_css(value)
            elif name == "http-equiv" and value.lower() == "refresh":
                content = attrs.get("content") or ""
                if "url=" in content.lower():
                    self.refs.append(("<meta refresh>", content[content.lower().index("url=") + 4 :].strip()))
        self._in = tag if tag in ("style", "script") else None

    def handle_endtag(self, tag):
        self._in = None

    def handle_data(self, data):
        if self._in == "style":
            self.refs += refs_in_css(data)
        elif self._in == "script":
            self.refs += refs_in_js(data)


def refs_in_html(text: str) -> list[tuple[str, str]]:
    parser = _HtmlRefs()
    parser.feed(text)
    parser.close()
    return parser.refs


SCANNERS = {".html": refs_in_html, ".css": refs_in_css, ".js": refs_in_js}


def external_refs(site_dir: Path) -> list[ExternalRef]:
    """Every external URL a browser could fetch from the built .html, .css and .js files of `site_dir`."""
    found = []
    for path in sorted(site_dir.rglob("*")):
        scan = SCANNERS.get(path.suffix)
        if scan and path.is_file():
            rel = path.relative_to(site_dir).as_posix()
            found += [
                ExternalRef(rel, how, url) for how, url in scan(path.read_text(errors="replace")) if is_external(url)
            ]
    return found

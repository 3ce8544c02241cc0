"""The built site in a real browser: Debian chromium driven by Playwright (no browser download).

Every page is loaded from a server on 127.0.0.1 while every request is recorded and any request for another
host is aborted, so a CDN fallback would show up here, not on a learner's machine. mkdocs-material renders
each mermaid diagram into a *closed* shadow root; an init script opens them so the test can read the SVG.
Screenshots go to build/site-screenshots/ to be looked at.
"""
from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.site.conftest import GOOD_LABELS, ROOT

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = ROOT / "build" / "site-screenshots"
# Runs before any page script: material's `attachShadow({mode: "closed"})` gets an open root instead.
OPEN_SHADOW_ROOTS = """
const attachShadow = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) { return attachShadow.call(this, {...init, mode: "open"}); };
"""
# What became of the page's mermaid blocks: material swaps each <pre class="mermaid"> for a <div class="mermaid">
# holding the SVG in its shadow root; mermaid reports a diagram it cannot parse with a "Syntax error" box.
DIAGRAM_REPORT = """() => ({
  svgTexts: [...document.querySelectorAll("div.mermaid")]
    .map(div => div.shadowRoot && div.shadowRoot.querySelector("svg"))
    .filter(svg => svg).map(svg => svg.textContent),
  syntaxError: document.body.textContent.includes("Syntax error"),
})"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site_url(diagram_site):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(_QuietHandler, directory=str(diagram_site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run tools/ensure-browser to install Debian's chromium "
                    "(make test does; needs root)", pytrace=False)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=30_000)
        yield browser
        browser.close()


@pytest.fixture
def visit(browser):
    """Open pages in a fresh context; yields (open_page, requested_urls) and closes the context after."""
    context = browser.new_context(service_workers="block")
    context.set_default_timeout(20_000)
    context.add_init_script(OPEN_SHADOW_ROOTS)
    requested: list[str] = []
    context.on("request", lambda request: requested.append(request.url))
    context.route("**/*", lambda route: route.continue_() if _is_loopback(route.request.url) else route.abort())

    def open_page(url: str):
        page = context.new_page()
        page.goto(url, wait_until="load")
        return page

    yield open_page, requested
    context.close()


def _is_loopback(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("data", "blob", "about") or parts.hostname == "127.0.0.1"


def _rendered(page, site_dir: Path, url_path: str) -> dict:
    """Wait until every mermaid block in the page's HTML is an SVG, or mermaid reported an error."""
    html_file = site_dir / (url_path.rstrip("/") + "/index.html" if url_path.strip("/") else "index.html")
    expected = html_file.read_text().count('<pre class="mermaid">')
    page.wait_for_function(f"() => ({DIAGRAM_REPORT})().svgTexts.length >= {expected} || "
                           f"({DIAGRAM_REPORT})().syntaxError")
    return {"expected": expected, **page.evaluate(DIAGRAM_REPORT)}


def _screenshot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def test_every_page_loads_from_127_0_0_1_only_and_its_diagrams_render(visit, site_url, diagram_site):
    open_page, requested = visit
    pages = sorted(p.parent.relative_to(diagram_site).as_posix() for p in diagram_site.rglob("index.html"))
    assert "diagram-check" in pages and "." in pages
    for path in pages:
        if path == "broken-diagram":
            continue  # the negative control, checked on its own below
        url_path = "" if path == "." else f"{path}/"
        page = open_page(site_url + url_path)
        report = _rendered(page, diagram_site, url_path)
        assert len(report["svgTexts"]) == report["expected"] and not report["syntaxError"], (path, report)
        _screenshot(page, path.replace("/", "-").replace(".", "home"))
    assert [url for url in requested if not _is_loopback(url)] == []
    # The diagrams were drawn by the vendored copy, fetched from this server.
    assert f"{site_url}assets/vendor/mermaid/mermaid.min.js" in requested


def test_mermaid_diagram_becomes_an_svg_with_its_labels(visit, site_url, diagram_site):
    open_page, requested = visit
    page = open_page(f"{site_url}diagram-check/")
    report = _rendered(page, diagram_site, "diagram-check/")
    assert report["expected"] == 2 and len(report["svgTexts"]) == 2 and not report["syntaxError"]
    text = " ".join(report["svgTexts"])
    assert [label for label in GOOD_LABELS if label not in text] == []
    assert [url for url in requested if not _is_loopback(url)] == []


def test_broken_diagram_is_reported_not_rendered(visit, site_url, diagram_site):
    """Negative control: the checks above would notice a diagram mermaid cannot draw."""
    open_page, _ = visit
    page = open_page(f"{site_url}broken-diagram/")
    report = _rendered(page, diagram_site, "broken-diagram/")
    _screenshot(page, "broken-diagram")
    assert report["expected"] == 1 and report["svgTexts"] == [] and report["syntaxError"]


def test_home_page_and_search_work_offline(visit, site_url):
    open_page, requested = visit
    page = open_page(site_url)
    heading = page.locator("article h1").inner_text()
    assert heading.removesuffix("¶") == "Reading Megatron-LM tensor parallelism and PyTorch FSDP"  # ¶: permalink
    # The index loads in a web worker after the page; material drops queries typed before it is ready.
    expect(page.locator(".md-search-result__meta")).to_have_text("Type to start searching")
    page.locator("input.md-search__input").press_sequentially("integrity")  # material reads keyup, not input
    page.locator(".md-search-result__item").first.wait_for()
    assert "self-hosted" in page.locator(".md-search-result").inner_text()
    assert f"{site_url}search/search_index.json" in requested
    assert [url for url in requested if not _is_loopback(url)] == []


def test_recorder_sees_and_blocks_requests_to_other_hosts(visit, site_url):
    """Positive control for the zero-external-requests assertions: a stray script tag is caught."""
    open_page, requested = visit
    page = open_page(site_url)
    with page.expect_event("requestfailed") as failed:
        page.evaluate("document.head.appendChild(Object.assign(document.createElement('script'), "
                      "{src: 'https://cdn.example.org/stray.js'}))")
    assert failed.value.url == "https://cdn.example.org/stray.js"
    assert [url for url in requested if not _is_loopback(url)] == ["https://cdn.example.org/stray.js"]


def test_without_the_vendored_script_material_would_fetch_mermaid_from_unpkg(visit, diagram_site, tmp_path):
    """Why mkdocs.yml loads the vendored mermaid: drop it from extra_javascript and material goes to its CDN."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    site = tmp_path / "site"
    build(load_config(config_file=str(ROOT / "mkdocs.yml"), docs_dir=str(diagram_site.parent / "docs"),
                      site_dir=str(site), extra_javascript=[]))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        open_page, requested = visit
        page = open_page(f"http://127.0.0.1:{server.server_address[1]}/diagram-check/")
        for _ in range(100):  # material asks for it right after the page has loaded
            if any("unpkg.com" in url for url in requested):
                break
            page.wait_for_timeout(100)
    finally:
        server.shutdown()
        server.server_close()
    assert "https://unpkg.com/mermaid@11/dist/mermaid.min.js" in requested

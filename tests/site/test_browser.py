"""The built site in a real browser: Debian chromium driven by Playwright (no browser download).

Every page is loaded once from a server on 127.0.0.1 while every request is recorded and any request for
another host is aborted, so a CDN fallback would show up here, not on a learner's machine. mkdocs-material
renders each mermaid diagram into a *closed* shadow root; an init script opens them so the test can read the
SVG. From the same visit, at 1280x1000 as a reader sees it: every excerpt's line numbers and text against the
installed upstream file, that 100 columns of code fit without scrolling, that each folded excerpt opens to
the whole citation, the size of every chart's text, the side navigation's order, and every link (each
"verified by" to its test's section). With SITE_SCREENSHOTS=1 each page is also saved, full length as a reader
first sees it, to build/site-screenshots/ to be looked at (off by default: it is a third of these tests' time).

Without /usr/bin/chromium these tests are skipped with a reason saying so (`pytest -ra` prints it); CI
installs it with tools/ensure-browser.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import re
import threading
import urllib.request
from html import unescape
from pathlib import Path
from urllib.parse import urldefrag, urlsplit

import pytest
from playwright.sync_api import expect, sync_playwright

from pin_and_cite.core.context import Context
from pin_and_cite.core.pins import Pins
from pin_and_cite.core.verified_by import evidence_of
from study.scale_tables import human
from tests.site.conftest import GOOD_LABELS, ROOT

pytestmark = pytest.mark.browser

CHROMIUM = Path(os.environ.get("SITE_TEST_CHROMIUM", "/usr/bin/chromium"))  # override: tests of the skip
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
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
# Each excerpt: the permalink in its caption (a folded excerpt's caption precedes its fold), or the path of our
# own file a reference page shows (its "our-code" caption), the line numbers
# shown, the text of each code line; and, where it is shown, how many columns of its monospace fit unscrolled.
# Code blocks but a walkthrough's Run it commands and their recorded output (study.run_it).
EXCERPTS = """() => [...document.querySelectorAll("article div.highlight:not(.run-it):not(.run-output)")].map(block => {
  const before = (block.closest(".excerpt-fold") || block).previousElementSibling;
  const caption = before && before.querySelector("a[href*='/blob/']");
  const ours = before && before.classList.contains("our-code") ? before.dataset.path : null;
  const code = block.querySelector("pre > code"), style = getComputedStyle(code);
  const ruler = document.createElement("canvas").getContext("2d");
  ruler.font = `${style.fontSize} ${style.fontFamily}`;
  const inner = code.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  return {permalink: caption ? caption.href : null, ours, shown: block.checkVisibility(),
          columns: inner / ruler.measureText("0".repeat(100)).width * 100,
          scrolls: code.scrollWidth > code.clientWidth,
          numbers: block.querySelector("td.linenos") ? block.querySelector("td.linenos").innerText.trim().split(/\\s+/)
          : [],
          lines: [...block.querySelectorAll("td.code code > span")].map(s => s.textContent.replace(/\\n$/, ""))};
})"""
LINKS = """() => [...document.querySelectorAll("a[href]")].map(a => a.href)"""
# Each Run it block's commands and output: does any of its lines run past the right edge (sideways scrolling)?
RUN_OUTPUTS = """() => [...document.querySelectorAll(
  "article div.run-it pre > code, article div.run-output pre > code")].map(
  code => code.scrollWidth > code.clientWidth)"""
VERIFIED_BY = """() => [...document.querySelectorAll("article a.verified-by")].map(a => ({
  href: a.href, node: a.querySelector("code").textContent}))"""
# The font size, in screen pixels, of every text of every SVG in the article: inline ones and mermaid's.
SVG_TEXT = """() => {
  const roots = [document, ...[...document.querySelectorAll("div.mermaid")].map(d => d.shadowRoot).filter(r => r)];
  return roots.flatMap(root => [...root.querySelectorAll("svg")])
    .filter(svg => svg.getRootNode() !== document || svg.closest("article"))
    .flatMap(svg => [...svg.querySelectorAll("text")].filter(t => t.textContent.trim() && t.getScreenCTM())
      .map(t => {
        const m = t.getScreenCTM();
        return [t.textContent.trim().slice(0, 40), parseFloat(getComputedStyle(t).fontSize) * Math.hypot(m.a, m.b)];
      }));
}"""
TIMELINES = """() => [...document.querySelectorAll("article .timeline svg")].map(svg => svg.textContent)"""
SIDE_NAV = """() => [...document.querySelectorAll(".md-sidebar--primary a.md-nav__link[href]")].map(a => a.href)"""
HOME_ORDER = """() => [...document.querySelector("#what-to-read-in-order").nextElementSibling.querySelectorAll("a")]
  .map(a => a.href)"""
VIEWPORT = {"width": 1280, "height": 1000}
# The only hosts a page links to (never loads from): upstream permalinks and material's footer credit.
MATERIAL_CREDIT = "https://squidfunk.github.io/mkdocs-material/"
SITE_PACKAGES = Path(importlib.util.find_spec("torch").origin).parents[1]  # without importing torch (2 s)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site_url(diagram_site):
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(diagram_site))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(
            f"BROWSER TESTS SKIPPED: {CHROMIUM} is missing; install Debian's chromium with "
            "tools/ensure-browser (as root; CI does) to run them"
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=30_000)
        yield browser
        browser.close()


def _context(browser, search: bool = True):
    """A fresh context that opens closed shadow roots and records every request, aborting non-loopback ones;
    returns (context, open_page, requested_urls). Without `search`, the request for the search index is
    recorded and aborted: material fetches it (1.3 MB) and indexes it anew in a worker on every page load, half
    of a page's load here, and only test_home_page_and_search_work_offline searches."""
    context = browser.new_context(service_workers="block", viewport=VIEWPORT)
    context.set_default_timeout(20_000)
    context.set_default_navigation_timeout(60_000)  # a page loads mermaid (3 MB): slow on a shared, busy CPU
    context.add_init_script(OPEN_SHADOW_ROOTS)
    requested: list[str] = []
    context.on("request", lambda request: requested.append(request.url))
    context.route("**/*", lambda route: route.continue_() if _is_loopback(route.request.url) else route.abort())
    if not search:
        context.route("**/search/search_index.json", lambda route: route.abort())

    def open_page(url: str):
        page = context.new_page()
        page.goto(url, wait_until="load")
        return page

    return context, open_page, requested


OPEN_ANSWERS = "document.querySelectorAll('details:not(.excerpt-whole)').forEach(d => { d.open = true; })"
OPEN_FOLDS = "document.querySelectorAll('details.excerpt-whole').forEach(d => { d.open = true; })"
# Each folded excerpt's two views (the window, the whole), as shown, with the line numbers of each; its summary.
FOLDS = """folds => folds.map(fold => ({
  views: [...fold.querySelectorAll("div.highlight")].map(block => ({
    shown: block.checkVisibility(), numbers: block.querySelector("td.linenos").innerText.trim().split(/\\s+/)})),
  summary: fold.querySelector("summary").innerText}))"""


@pytest.fixture
def visit(browser):
    """Open pages in a fresh context; yields (open_page, requested_urls) and closes the context after."""
    context, open_page, requested = _context(browser)
    yield open_page, requested
    context.close()


@pytest.fixture
def unsearched(browser):
    """As `visit`, for a test that never searches: the search index is not loaded (_context)."""
    context, open_page, requested = _context(browser, search=False)
    yield open_page, requested
    context.close()


@pytest.fixture(scope="module")
def every_page(browser, site_url, diagram_site):
    """Each page but the negative control and the generated test pages (fetched by their own test), visited
    once: its diagrams, folds, excerpts, SVG text, evidence links and links; plus all requests."""
    context, _, requested = _context(browser, search=False)
    pages = sorted(p.parent.relative_to(diagram_site).as_posix() for p in diagram_site.rglob("index.html"))
    reports = {}
    page = context.new_page()  # one tab, as a reader follows links: each page is still a full load
    for path in pages:
        if path == "broken-diagram" or path.startswith("notes/tests/"):
            continue  # the negative control, checked on its own below; the test pages, by their own test
        url_path = "" if path == "." else f"{path}/"
        page.goto(site_url + url_path, wait_until="load")
        diagrams = _rendered(page, diagram_site, url_path)
        _screenshot(page, "home" if path == "." else path.replace("/", "-"))  # as a reader first sees it
        page.evaluate(OPEN_ANSWERS)  # excerpts inside collapsed answers are checked as a reader opens them
        reports[path] = {
            "diagrams": diagrams,
            "folds": _unfold(page),
            "svg_text": page.evaluate(SVG_TEXT),
            "timelines": page.evaluate(TIMELINES),
            "verified_by": page.evaluate(VERIFIED_BY),
            "side_nav": page.evaluate(SIDE_NAV),
        }
        page.evaluate(OPEN_FOLDS)
        reports[path].update(
            excerpts=page.evaluate(EXCERPTS), links=page.evaluate(LINKS), run_outputs=page.evaluate(RUN_OUTPUTS)
        )
        if path == ".":
            reports[path]["home_order"] = page.evaluate(HOME_ORDER)
    context.close()
    return reports, requested


def _unfold(page) -> list[dict]:
    """Each folded excerpt: the line numbers it shows, then, after a click on its summary, what it shows."""
    folds = page.locator(".excerpt-fold")
    before = folds.evaluate_all(FOLDS)
    for i in range(len(before)):
        folds.nth(i).locator("summary").click()  # a real click, where a reader clicks
    after = folds.evaluate_all(FOLDS)
    return [
        {"before": b["views"], "after": a["views"], "summary": a["summary"]} for b, a in zip(before, after, strict=True)
    ]


def _is_loopback(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("data", "blob", "about") or parts.hostname == "127.0.0.1"


def _rendered(page, site_dir: Path, url_path: str) -> dict:
    """Wait until every mermaid block in the page's HTML is an SVG, or mermaid reported an error."""
    html_file = site_dir / (url_path.rstrip("/") + "/index.html" if url_path.strip("/") else "index.html")
    expected = html_file.read_text().count('<pre class="mermaid">')
    page.wait_for_function(
        f"() => ({DIAGRAM_REPORT})().svgTexts.length >= {expected} || ({DIAGRAM_REPORT})().syntaxError"
    )
    return {"expected": expected, **page.evaluate(DIAGRAM_REPORT)}


def _screenshot(page, name: str) -> None:
    if os.environ.get("SITE_SCREENSHOTS") != "1":
        return
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def test_every_page_loads_from_127_0_0_1_only_and_its_diagrams_render(every_page, site_url):
    reports, requested = every_page
    assert {
        ".",
        "diagram-check",
        "notes/synthesis",
        "notes/megatron-tp-layers",
        "notes/fsdp-prefetch",
        "notes/megatron-pipeline-1f1b",
        "notes/dtensor-tp",
        "notes/sources/megatron-lm",
        "notes/reference/fsdp.runtime",
    } <= set(reports)
    for path, report in reports.items():
        diagrams = report["diagrams"]
        assert len(diagrams["svgTexts"]) == diagrams["expected"] and not diagrams["syntaxError"], (path, diagrams)
    assert [url for url in requested if not _is_loopback(url)] == []
    # The diagrams were drawn by the vendored copy, fetched from this server.
    assert f"{site_url}assets/vendor/mermaid/mermaid.min.js" in requested


def test_synthesis_diagrams_drawn_from_recorded_runs_render_with_their_labels(every_page):
    report = every_page[0]["notes/synthesis"]
    diagrams = report["diagrams"]
    assert diagrams["expected"] == 2 and not diagrams["syntaxError"]
    (tp_block, tp_block_llama), (fsdp_timeline, _calibrated) = diagrams["svgTexts"], report["timelines"]
    both = (
        "qkv · ColumnParallelLinear",
        "proj · RowParallelLinear",
        "scaled dot-product attention",
        "all-reduce 1, forward: 4 KiB over intra-node NVLink ~600 GB/s",
        "all-reduce 2, forward",
        "backward: all-reduce of dX, 4 KiB",
    )
    for label in (*both, "GELU", "ln1 · LayerNorm"):
        assert label in tp_block, label
    for label in (*both, "rotary ×2", "SwiGLU", "ln1 · RMSNorm", "weight 64 × 64 per rank"):
        assert label in tp_block_llama, label
    for label in (
        "forward compute",
        "backward compute",
        "all-gather",
        "reduce-scatter",
        "root forward",
        "layers.0 forward",
        "layers.1 backward",
        "AG layers.1",  # a collective's tooltip names its unit, and it sits on that unit's row
        "RS root",
        "until layers.0 started; its post-backward hook fired later",
        "modeled at 1 TFLOP/s, 25 GB/s",
    ):
        assert label in fsdp_timeline, label


def test_pipeline_timelines_drawn_from_recorded_steps_render_a_row_per_stage(every_page):
    timelines = every_page[0]["notes/megatron-pipeline-1f1b"]["timelines"]
    assert len(timelines) == 2
    for svg, title in zip(timelines, ("GPipe, 4 stages, 8 micro-batches", "1F1B, 4 stages, 8 micro-batches")):
        for label in (title, "stage 0", "stage 3", "F0", "F7", "B0", "B7", "µs, modeled at 1 TFLOP/s, 25 GB/s"):
            assert label in svg, (title, label)
    walked = every_page[0]["notes/walkthrough-pipeline"]["timelines"]  # every schedule, on one axis
    titles = (
        "GPipe, 4 stages",
        "1F1B, 4 stages",
        "Interleaved 1F1B (2 chunks per stage), 4 stages",
        "1F1B, 4 stages",  # again, beside the zero-bubble schedules
        "ZB-H1, 4 stages",
        "ZB-V (2 stages per rank, in a V), 4 stages",
        "DualPipeV (2 stages per rank, in a V), 4 stages",
    )
    assert len(walked) == len(titles) and all(title in svg for svg, title in zip(walked, titles))
    for svg in walked[4:]:
        assert all(label in svg for label in ("I0", "W0", "stage 3")), svg[:80]


def test_excerpts_show_upstream_line_numbers_and_text(every_page):
    """Each excerpt, as the browser shows it, against the installed upstream file (byte-identical to the pin);
    each block of our own code on a reference page against our file."""
    pins = Pins(ROOT / "reading_notes" / "pins.toml").sources
    checked, checked_ours = {}, set()
    for path, report in every_page[0].items():
        for excerpt in report["excerpts"]:
            if excerpt["ours"]:  # a reference page's own code (render.OUR_CODE): our file's lines and numbers
                numbers = [int(n) for n in excerpt["numbers"]]
                ours = (ROOT / excerpt["ours"]).read_text().split("\n")
                assert excerpt["lines"] == ours[numbers[0] - 1 : numbers[-1]], (path, excerpt["ours"], numbers[0])
                checked_ours.add(excerpt["ours"])
                continue
            if excerpt["permalink"] is None:  # a plain code block of a hand-written page (architecture)
                assert not path.startswith("notes/"), (path, excerpt["lines"][:2])  # every note block cites
                continue
            source = next(s for s in pins.values() if excerpt["permalink"].startswith(s.url.removesuffix(".git")))
            file, lines = excerpt["permalink"].split(f"/blob/{source.commit}/", 1)[1].split("#")
            first, last = (int(n) for n in lines.removeprefix("L").split("-L"))
            upstream = (SITE_PACKAGES / file).read_text().split("\n")
            numbers = [int(n) for n in excerpt["numbers"]]
            assert numbers == list(range(numbers[0], numbers[-1] + 1)), (path, excerpt["permalink"])
            assert first <= numbers[0] and numbers[-1] <= last, (path, excerpt["permalink"])  # a fold: a part
            assert excerpt["lines"] == upstream[numbers[0] - 1 : numbers[-1]], (path, excerpt["permalink"])
            if numbers == list(range(first, last + 1)):
                checked[f"{file}#L{first}"] = excerpt["numbers"][0]
    assert checked["megatron/core/tensor_parallel/layers.py#L920"] == "920"  # a block citing L920 shows 920
    assert checked["torch/distributed/fsdp/_runtime_utils.py#L411"] == "411"
    assert len(checked) >= 20
    assert "reference/data_parallel/buckets.py" in checked_ours and len(checked_ours) >= 20


def test_100_columns_of_code_fit_every_excerpt_without_scrolling(every_page):
    """At 1280 px with the side navigation and the table of contents shown, each shown excerpt (open answers,
    open folds) has room for 100 columns, so no line of up to 100 columns needs sideways scrolling."""
    shown = [
        (path, e)
        for path, report in every_page[0].items()
        if path.startswith("notes/")
        for e in report["excerpts"]
        if e["shown"]
    ]
    assert len(shown) >= 50
    assert [(path, e["permalink"], round(e["columns"])) for path, e in shown if e["columns"] < 100] == []
    short = [(path, e) for path, e in shown if max(map(len, e["lines"])) <= 100]
    assert short and [(path, e["permalink"]) for path, e in short if e["scrolls"]] == []


def test_run_it_output_wraps_so_the_numbers_at_line_ends_show_at_1280_px(every_page):
    """Issue 24: the step line's `tp: all_reduce x52 (329216 B)`, the number the walkthrough explains, sat past
    the right edge of its output block, reachable only by scrolling sideways; the flag an exercise adds sat at
    the end of its command, cut the same way."""
    outputs = {path: report["run_outputs"] for path, report in every_page[0].items() if report["run_outputs"]}
    assert len(outputs.get("notes/walkthrough-tp", [])) >= 8  # commands and output: the Run it block, each exercise
    assert {"notes/walkthrough-pipeline", "notes/walkthrough-dp", "notes/walkthrough-dtensor"} <= outputs.keys()
    assert {path: scrolls for path, scrolls in outputs.items() if any(scrolls)} == {}


def test_every_folded_excerpt_expands_on_click_to_the_whole_citation_with_upstream_numbers(every_page):
    folds = [(path, fold) for path, report in every_page[0].items() for fold in report["folds"]]
    assert len(folds) >= 10 and any(path == "notes/megatron-tp-layers" for path, _ in folds)
    for path, fold in folds:
        (window, whole), (window_after, whole_after) = fold["before"], fold["after"]
        assert window["shown"] and not whole["shown"], (path, fold)  # folded: the window only
        assert not window_after["shown"] and whole_after["shown"], (path, fold)  # clicked: the whole excerpt
        first, last = int(whole_after["numbers"][0]), int(whole_after["numbers"][-1])
        assert whole_after["numbers"] == [str(n) for n in range(first, last + 1)]
        assert fold["summary"] == f"Show all {last - first + 1} lines, L{first}–L{last}"
        assert set(window["numbers"]) < set(whole_after["numbers"]), (path, fold)


def test_every_chart_and_timeline_text_is_at_least_11_px(every_page):
    sizes = {path: report["svg_text"] for path, report in every_page[0].items() if path.startswith("notes/")}
    assert sum(map(len, sizes.values())) >= 100 and sizes["notes/scale"] and sizes["notes/synthesis"]
    assert [(path, text, round(px, 1)) for path, texts in sizes.items() for text, px in texts if px < 11] == []


def test_side_navigation_lists_the_notes_in_the_home_pages_order(every_page, site_url):
    home = every_page[0]["."]
    order = [url.removeprefix(site_url) for url in home["home_order"]]
    nav = list(dict.fromkeys(url.removeprefix(site_url) for url in home["side_nav"]))
    assert len(order) >= 10 and order[:2] == ["notes/walkthrough-tp/", "notes/megatron-tp-layers/"]
    assert [page for page in nav if page in order] == list(dict.fromkeys(order))


def test_every_verified_by_link_opens_a_page_holding_that_tests_source(every_page):
    links = {(link["href"], link["node"]) for report in every_page[0].values() for link in report["verified_by"]}
    assert len(links) >= 40
    for href, node in sorted(links):
        page_url, anchor = urldefrag(href)
        with urllib.request.urlopen(page_url, timeout=10) as response:
            html = response.read().decode()
        section = html.split(f'id="{anchor}"', 1)[1].split("<h2", 1)[0]  # the test's section of its file's page
        text = unescape(re.sub(r"<[^>]+>", "", section))
        evidence = evidence_of(Context(ROOT), node)
        first, last = evidence.lines
        source = (ROOT / node.split("::")[0]).read_text().split("\n")[first - 1 : last]
        name = node.split("::")[-1].split("[")[0]
        assert f"def {name}(" in text and all(line.strip() in text for line in source), href
        assert ("upstream test" if evidence.kind == "upstream" else "reference test") in text, href
        assert re.search(rf'href="#__codelineno-\d+-{first}">\s*{first}</a>', section), href  # as in the test file


def test_every_link_resolves(every_page, site_url):
    pins = Pins(ROOT / "reading_notes" / "pins.toml").sources
    permalinks = tuple(f"{s.url.removesuffix('.git')}/blob/{s.commit}/" for s in pins.values())
    local, external = set(), set()
    for report in every_page[0].values():
        for href in report["links"]:
            (local if _is_loopback(href) else external).add(urldefrag(href).url)
    assert [url for url in external if not url.startswith(permalinks) and url != MATERIAL_CREDIT] == []
    assert any(url.startswith(permalinks[0]) for url in external) and any(u.startswith(permalinks[1]) for u in external)
    broken = []
    for url in sorted(local):
        try:
            urllib.request.urlopen(url, timeout=10).close()
        except OSError as error:
            broken.append(f"{url}: {error}")
    assert broken == [] and f"{site_url}notes/sources/pytorch/" in local


def test_mermaid_diagram_becomes_an_svg_with_its_labels(visit, site_url, diagram_site):
    open_page, requested = visit
    page = open_page(f"{site_url}diagram-check/")
    report = _rendered(page, diagram_site, "diagram-check/")
    assert report["expected"] == 3 and len(report["svgTexts"]) == 3 and not report["syntaxError"]
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
    # Material answers every prefix as it is typed ("int" finds "initialization"): wait for the last query's results.
    expect(page.locator(".md-search-result")).to_contain_text("self-hosted")
    assert f"{site_url}search/search_index.json" in requested
    assert [url for url in requested if not _is_loopback(url)] == []


def test_recorder_sees_and_blocks_requests_to_other_hosts(visit, site_url):
    """Positive control for the zero-external-requests assertions: a stray script tag is caught."""
    open_page, requested = visit
    page = open_page(site_url)
    with page.expect_event("requestfailed") as failed:
        page.evaluate(
            "document.head.appendChild(Object.assign(document.createElement('script'), "
            "{src: 'https://cdn.example.org/stray.js'}))"
        )
    assert failed.value.url == "https://cdn.example.org/stray.js"
    assert [url for url in requested if not _is_loopback(url)] == ["https://cdn.example.org/stray.js"]


def test_without_the_vendored_script_material_would_fetch_mermaid_from_unpkg(visit, diagram_site, tmp_path):
    """Why mkdocs.yml loads the vendored mermaid: drop it from extra_javascript and material goes to its CDN."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    site = tmp_path / "site"
    build(
        load_config(
            config_file=str(ROOT / "mkdocs.yml"),
            docs_dir=str(diagram_site.parent / "docs"),
            site_dir=str(site),
            extra_javascript=[],
        )
    )
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


def test_check_yourself_answers_are_collapsed_until_opened(visit, site_url):
    """Each question's answer is a closed <details>; opening it shows cited upstream lines and its evidence."""
    open_page, _ = visit
    page = open_page(site_url + "notes/check-yourself/")
    answers = page.locator("details:not(.excerpt-whole)")  # not the folded excerpts inside them
    assert answers.count() >= 16  # two questions to answer first and fourteen on the close readings
    assert page.evaluate("[...document.querySelectorAll('details')].every(d => !d.open)")
    first = answers.first
    assert not first.locator(".verified-by").first.is_visible()
    first.locator(":scope > summary").click()
    assert first.evaluate("d => d.open")
    assert first.locator(".verified-by").first.is_visible()
    assert first.locator("div.highlight td.linenos").first.is_visible()


# Each code block of a test page: does a line run past its right edge (sideways scrolling)?
CODE_SCROLLS = """() => [...document.querySelectorAll("article div.highlight pre > code")].map(
  code => code.scrollWidth > code.clientWidth)"""


def test_test_pages_show_every_line_whole_and_link_the_helpers_that_run_upstream(unsearched, site_url, diagram_site):
    """Issue 24: the pages of cited tests cut lines past 100 columns (ruff allows 120), and showed only the test,
    not the function of its file that builds and runs upstream (megatron's `cases` -> `records` -> `column`)."""
    open_page, _ = unsearched
    pages = sorted(
        p.parent.relative_to(diagram_site).as_posix() for p in (diagram_site / "notes" / "tests").rglob("index.html")
    )
    assert len(pages) >= 10
    page = open_page(site_url)  # one tab, as a reader follows links
    for path in pages:
        page.goto(f"{site_url}{path}/", wait_until="load")
        assert not any(page.evaluate(CODE_SCROLLS)), path
    page.goto(site_url + "notes/tests/evidence/test_megatron_upstream_claims/", wait_until="load")
    test = page.locator("#test_column_defaults_allreduce_dx_async_between_dx_and_dw_gemms")
    assert test.is_visible()
    page.locator("article a[href='#calls.cases']").first.click()
    helper = page.locator("[id='calls.cases']")
    expect(helper).to_be_in_viewport()
    code = helper.locator("xpath=following::div[contains(@class,'highlight')][1]")
    assert "def cases(" in code.inner_text()
    assert page.locator("[id='calls.column']").count() == 1  # reached through cases -> records -> layer_cases


def test_each_note_links_the_previous_and_next_page_in_the_reading_order(visit, site_url):
    """Issue 24: a reader at the end of a page had no link on to the next one."""
    open_page, _ = visit
    page = open_page(site_url + "notes/megatron-tp-layers/")
    previous, following = page.locator("a.md-footer__link--prev"), page.locator("a.md-footer__link--next")
    assert previous.get_attribute("href").rstrip("/").endswith("walkthrough-tp")
    assert following.is_visible() and "Previous" in previous.inner_text() and "Next" in following.inner_text()


# The Scale page's calculator: layouts to set, each with what makes it worth a look.
CALCULATOR_LAYOUTS = [
    # two stages, every switch on; 80,560 B of masters is 80.625 KiB: a tie, which Python rounds to even
    dict(model="small", tp=2, pp=2, dp=4, microbatches=4, sp=1, distributed_optimizer=1),
    dict(model="gpt-70b-shape", tp=4, pp=4, dp=8, microbatches=32, sp=0, distributed_optimizer=0),  # 3 stages
    dict(model="llama3-70b", tp=1, pp=1, dp=1, microbatches=1, sp=1, distributed_optimizer=0),  # 1 GPU, no groups
]
CALCULATOR_HELD = ("parameters", "gradients", "master_weights", "optimizer_states")


def _set_layout(page, layout: dict) -> None:
    """Set the calculator's controls as a reader does: pick each option, tick or untick each box."""
    calculator = page.locator(".scale-calculator")
    for name, value in layout.items():
        control = calculator.locator(f"[name={name}]")
        if name in ("sp", "distributed_optimizer"):
            control.set_checked(bool(value))
        else:
            control.select_option(str(value))


def test_scale_calculator_shows_the_reference_numbers_for_the_layout_set(visit, site_url):
    """Set in Chromium, the calculator shows, per traced stage, the bytes held, the bytes per group and the
    bubble that reference.measure.scale.grid.lookup gives for the layout (tests/reference/test_scale_grid.py:
    the closed forms of reference.measure.scale.formulas, and the CLI's traced runs), in
    reference.measure.scale.formulas.human's units, and the command that traces it; a layout the reference
    refuses shows its refusal."""
    from reference.measure.scale import grid  # imports torch: only here

    doc = json.loads((ROOT / "reading_notes" / "traces" / "layout_grid.json").read_text())
    open_page, requested = visit
    page = open_page(f"{site_url}notes/scale/")
    calculator = page.locator(".scale-calculator")
    for layout in CALCULATOR_LAYOUTS:
        _set_layout(page, layout)
        found = grid.lookup(doc, layout)
        shown = calculator.locator("thead th").all_inner_texts()[1:]
        assert shown == [
            f"stage {s['stage']} ({_where(s['stage'], layout['pp'])}), rank {s['rank']}" for s in found["stages"]
        ], layout
        for s in found["stages"]:
            cells = {
                row: calculator.locator(f'td[data-stage="{s["stage"]}"][data-row="{row}"]')
                for row in (*CALCULATOR_HELD, "total", "tp", "pp", "dp")
            }
            for what in CALCULATOR_HELD:
                assert cells[what].locator(".scale-calculator__bytes").inner_text() == human(s["held"][what])
            total = sum(s["held"].values())
            assert cells["total"].locator(".scale-calculator__bytes").inner_text() == human(total)
            for group in ("tp", "pp", "dp"):
                rows = [r for r in s["rows"] if r[0] == group]
                text = cells[group].inner_text().split("\n")
                if rows:
                    assert text == [human(sum(r[3] for r in rows)), ", ".join(f"{r[2]} × {r[1]}" for r in rows)]
                else:
                    assert text == ["—"] and layout[group] == 1, (layout, group)
        world = layout["tp"] * layout["pp"] * layout["dp"]
        summary = calculator.locator(".scale-calculator__result > p").first.inner_text()
        assert f"= {world:,} GPU{'s' * (world != 1)}, " in summary, summary
        bubble = calculator.locator(".scale-calculator__bubble")
        assert float(bubble.get_attribute("data-value")) == found["bubble"]
        assert bubble.inner_text() == f"{100 * found['bubble']:.1f} %"
        assert calculator.locator(".scale-calculator__command").inner_text() == (
            f".venv/bin/python -m reference.measure.scale --model {layout['model']} --tp {layout['tp']} "
            f"--pp {layout['pp']} --dp {layout['dp']} --micro-batches {layout['microbatches']}"
            + " --sequence-parallel" * layout["sp"]
            + " --dp-sharding optimizer" * layout["distributed_optimizer"]
        )
    _set_layout(page, dict(model="small", pp=8))  # 4 layers
    assert calculator.locator(".scale-calculator__refusal").inner_text() == (
        "python -m reference.measure.scale refuses this layout: 8 pipeline stages but only 4 layers."
    )
    assert calculator.locator("table").count() == 0
    # Python's rounding of ties to the even digit, thousands separators, and bytes below a KiB
    for nbytes in (80_560, 1_152 * 2**20, 3 * 2**29 + 5 * 2**20, 1234 * 2**30 + 2**24, 1023, 1024, 0):
        assert page.evaluate(f"scaleCalculator.human({nbytes})") == human(nbytes), nbytes
    assert [url for url in requested if not _is_loopback(url)] == []


CP_LAYOUTS = [  # Llama 3's long-context layout, and a small one whose K/V step is below a MiB
    dict(model="405b", tp=8, cp=16, pp=16, dp=1, microbatches=16, sp=0, distributed_optimizer=0),
    dict(model="small", tp=2, cp=4, pp=2, dp=2, microbatches=4, sp=0, distributed_optimizer=0),
]


def test_scale_calculator_shows_the_cp_rows_of_the_layout_set(visit, site_url):
    """At CP > 1 the calculator shows reference.measure.scale.grid.cp_lookup's rows for the layout (the closed forms
    of formulas.cp_rows, which tests/reference/test_scale_grid.py checks against the CLI's traced ring), its stage
    totals with the attention activations at CP 1 beside them, and the `--cp` command; back at CP 1 the dense
    tables, and a switch the CP rows leave out, the CLI's refusal."""
    from reference.measure.scale import grid  # imports torch: only here

    doc = json.loads((ROOT / "reading_notes" / "traces" / "layout_grid.json").read_text())
    open_page, requested = visit
    page = open_page(f"{site_url}notes/scale/")
    calculator = page.locator(".scale-calculator")
    for layout in CP_LAYOUTS:
        _set_layout(page, layout)
        found = grid.cp_lookup(doc, layout)
        at_one = grid.cp_lookup(doc, {**layout, "cp": 1})

        def shown(row):
            return calculator.locator(f'td[data-stage="cp"][data-row="{row}"]').inner_text().split("\n")

        for what, _, nbytes, _ in found["rows"]:
            assert shown(what) == [human(nbytes)], (layout, what)
        assert shown("ring_bytes_per_stage") == [
            human(found["ring_bytes_per_stage"]),
            f"{human(found['ring_bytes_per_layer'])} a layer",
        ]
        ratio = at_one["saved_bytes_per_stage"] / found["saved_bytes_per_stage"]
        assert ratio == layout["cp"]
        assert shown("saved_bytes_per_stage") == [
            human(found["saved_bytes_per_stage"]),
            f"at CP 1: {human(at_one['saved_bytes_per_stage'])}, {layout['cp']} times as much",
        ]
        assert calculator.locator(".scale-calculator__command").inner_text() == (
            f".venv/bin/python -m reference.measure.scale --model {layout['model']} --tp {layout['tp']} "
            f"--cp {layout['cp']} --pp {layout['pp']} --dp {layout['dp']} --micro-batches {layout['microbatches']}"
        )
    _set_layout(page, dict(sp=1))
    assert calculator.locator(".scale-calculator__refusal").inner_text() == (
        f"python -m reference.measure.scale refuses this layout: {doc['cp']['refusals']['sp']}."
    )
    _set_layout(page, dict(sp=0, cp=1))
    assert calculator.locator("thead th").count() == 1 + 2  # the dense table again: small at PP 2, two stages
    assert [url for url in requested if not _is_loopback(url)] == []


def _where(stage: int, stages: int) -> str:
    return "only" if stages == 1 else "first" if stage == 0 else "last" if stage == stages - 1 else "middle"

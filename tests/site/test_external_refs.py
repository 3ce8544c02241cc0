"""The static scanner itself: it must tell what a browser fetches from text that merely mentions a URL."""

from __future__ import annotations

from tests.site.external_refs import is_external, refs_in_css, refs_in_html, refs_in_js


def test_scanner_tells_fetches_from_text_links():
    html = """<html><head>
      <link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">
      <link rel="preconnect" href="https://fonts.gstatic.com">
      <link rel="canonical" href="https://example.org/page/">
      <script src="//cdn.jsdelivr.net/npm/mermaid.js"></script>
      <script src="assets/local.js"></script>
      <style>@import "https://cdn.example/a.css"; body{background:url(http://127.0.0.1:8000/bg.png)}</style>
      <script>load("https://unpkg.com/x.js"); msg = "see https://docs.example/help for details";</script>
    </head><body>
      <a href="https://github.com/NVIDIA/Megatron-LM">text link</a>
      <img srcset="img/a.png 1x, https://img.example/b.png 2x">
      <svg xmlns="http://www.w3.org/2000/svg"><use href="https://icons.example/s.svg#i"/></svg>
      <div style="background-image: url('https://img.example/c.png')"></div>
    </body></html>"""
    fetched = {url for _, url in refs_in_html(html) if is_external(url)}
    assert fetched == {
        "https://fonts.googleapis.com/css?family=Roboto",
        "https://fonts.gstatic.com",
        "//cdn.jsdelivr.net/npm/mermaid.js",
        "https://cdn.example/a.css",
        "https://unpkg.com/x.js",
        "https://img.example/b.png",
        "https://icons.example/s.svg#i",
        "https://img.example/c.png",
    }
    css = "@import url(https://fonts.example/f.css);"
    assert [url for _, url in refs_in_css(css)] == ["https://fonts.example/f.css"]
    assert refs_in_js('e.setAttribute("xmlns","http://www.w3.org/2000/svg")') and not is_external(
        "http://www.w3.org/2000/svg"
    )
    assert not is_external("http://localhost:8000/x.js") and not is_external("https://")

"""The real site builds strictly, serves the pinned mermaid, and its files fetch nothing from other hosts."""
from __future__ import annotations

import hashlib
import re
import shutil

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

from tests.site.conftest import ROOT, vendor_assets
from tests.site.external_refs import external_refs

BUNDLE = re.compile(r"assets/javascripts/bundle\.[0-9a-f]+\.min\.js")
# Fallbacks inside mkdocs-material's own bundle. Each is a code path the site never takes, for the reason
# given; the browser test loads every page with such requests blocked and recorded. Listed exactly so that any new URL fails.
MATERIAL_FALLBACKS = {
    "https://unpkg.com/mermaid@11/dist/mermaid.min.js": "loaded only when window.mermaid is undefined; "
                                                        "extra_javascript defines it first",
    "https://unpkg.com/resize-observer-polyfill": "loaded only by browsers without ResizeObserver",
    "https://api.github.com/repos/${e}/${t}": "repository facts, fetched only when repo_url is set",
    "https://api.github.com/users/${e}": "repository facts, fetched only when repo_url is set",
    "https://${e}/api/v4/projects/${encodeURIComponent(t)}": "GitLab facts, fetched only when repo_url is set",
}


def test_built_site_fetches_nothing_from_other_hosts(built_site):
    found = external_refs(built_site)
    unexplained = [ref for ref in found if not (BUNDLE.fullmatch(ref.file) and ref.url in MATERIAL_FALLBACKS)]
    assert unexplained == [], "built files would fetch from other hosts:\n" + "\n".join(map(str, unexplained))
    # Positive control: the scanner does see the fallbacks it excuses, so it is reading the real bundle.
    assert {ref.url for ref in found} == set(MATERIAL_FALLBACKS)


def test_config_keeps_material_off_its_cdns():
    config = load_config(config_file=str(ROOT / "mkdocs.yml"))
    assert config.theme["font"] is False, "web fonts would load from fonts.googleapis.com"
    assert config.repo_url is None, "material would fetch repository facts from api.github.com"
    assert "material/offline" not in config.plugins, "material's offline plugin adds an unpkg.com script"
    scripts = [str(script) for script in config.extra_javascript]
    assert {asset.dest for asset in vendor_assets.load_lock()} <= set(scripts), "vendored scripts must be loaded"


def test_built_site_serves_the_pinned_mermaid_before_material_needs_it(built_site):
    (mermaid,) = [a for a in vendor_assets.load_lock() if a.name == "mermaid"]
    served = (built_site / mermaid.dest).read_bytes()
    assert hashlib.sha512(served).hexdigest() == mermaid.file_sha512
    html = (built_site / "index.html").read_text()
    scripts = re.findall(r'<script src="([^"]+)"', html)
    assert scripts.index(mermaid.dest) > 0, scripts
    # A plain (not deferred, not module) script: it defines window.mermaid before DOMContentLoaded,
    # which is when material decides whether to fetch its CDN copy.
    assert f'<script src="{mermaid.dest}"></script>' in html


@pytest.mark.parametrize("damage", ["missing", "altered"])
def test_build_stops_with_one_line_reason_without_verified_mermaid(vendored_docs, tmp_path, caplog, damage):
    docs = tmp_path / "docs"
    shutil.copytree(vendored_docs, docs)
    (mermaid,) = [a for a in vendor_assets.load_lock() if a.name == "mermaid"]
    if damage == "missing":
        (docs / mermaid.dest).unlink()
    else:
        with open(docs / mermaid.dest, "ab") as f:
            f.write(b"\n// edited\n")
    config = load_config(config_file=str(ROOT / "mkdocs.yml"), docs_dir=str(docs), site_dir=str(tmp_path / "site"))
    with pytest.raises(Abort, match="BuildError"):
        build(config)
    (message,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]  # what the CLI prints
    assert "\n" not in message and "run tools/vendor-assets" in message
    assert ("is missing" if damage == "missing" else "does not match the sha512 pinned for mermaid@") in message
    assert not (tmp_path / "site" / "index.html").exists()

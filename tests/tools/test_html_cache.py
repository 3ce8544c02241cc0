"""The converted-page cache (pin_and_cite.site.html_cache) lets a warm `mkdocs build` skip Python-Markdown for a
page whose Markdown and place among the site's files are as they were, and never changes what a build
publishes or reports: the site is the same file for file, a planted entry is converted afresh, and a broken
link or anchor fails `--strict` on every build, also when only the page it points to changed."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOOK = "import os\nfrom pathlib import Path\nfrom pin_and_cite.site import html_cache\n\n\ndef on_config(config):\n"
HOOK += "    if os.environ.get('HTML_CACHE'):\n        html_cache.install(Path(os.environ['HTML_CACHE']))\n"


@pytest.fixture
def site(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\nSee [the part](b.md#part).\n\n## Section\n\ntext\n")
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## Part\n\n```python\nx = 1\n```\n")
    (tmp_path / "hook.py").write_text(HOOK)
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: t\ntheme: mkdocs\nhooks: [hook.py]\nvalidation:\n  anchors: warn\n"
        "markdown_extensions: [toc, pymdownx.highlight, pymdownx.superfences]\n"
    )
    return tmp_path


def build(site: Path, out: str, cached: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tools'}:{ROOT}", "HTML_CACHE": str(site / "cache") if cached else ""}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site / out)]
    return subprocess.run(cmd, cwd=site, env=env, capture_output=True, text=True)


def entries(site: Path) -> list[Path]:
    return sorted((site / "cache" / "html").rglob("*.json"))


def published(out: Path) -> dict[str, bytes]:
    """Each file of a built site (the theme's "Build Date" comment and the sitemap's dates left out)."""
    return {
        str(p.relative_to(out)): re.sub(rb"Build Date UTC : [^\n]*", b"", p.read_bytes())
        for p in sorted(out.rglob("*"))
        if p.is_file() and not p.name.startswith("sitemap.xml")
    }


def same_site(a: Path, b: Path) -> bool:
    return published(a) == published(b)


def test_a_warm_build_publishes_the_same_site(site):
    assert build(site, "plain", cached=False).returncode == 0
    assert build(site, "cold").returncode == 0
    assert len(entries(site)) == 2
    kept = [p.stat().st_mtime_ns for p in entries(site)]
    assert build(site, "warm").returncode == 0
    assert [p.stat().st_mtime_ns for p in entries(site)] == kept  # read, not written again
    assert same_site(site / "plain", site / "warm") and same_site(site / "plain", site / "cold")


def test_a_planted_entry_changes_nothing(site):
    assert build(site, "cold").returncode == 0
    for entry in entries(site):
        stored = json.loads(entry.read_bytes())
        planted = json.loads(stored["text"]) | {"content": "<script>planted</script>"}
        entry.write_text(json.dumps({**stored, "text": json.dumps(planted)}))
    assert build(site, "warm").returncode == 0
    assert "planted" not in (site / "warm" / "index.html").read_text()
    assert same_site(site / "cold", site / "warm")


def test_a_broken_link_fails_every_strict_build(site):
    (site / "docs" / "index.md").write_text("# Home\n\nSee [gone](c.md).\n")
    for _ in range(2):
        run = build(site, "out")
        assert run.returncode == 1 and "c.md" in run.stderr, run.stderr
    assert len(entries(site)) == 1  # b's; a page that logged is never kept


def test_an_anchor_gone_from_the_linked_page_fails_the_unchanged_page(site):
    assert build(site, "cold").returncode == 0
    (site / "docs" / "b.md").write_text("# B\n\n## Other\n")
    run = build(site, "warm")
    assert run.returncode == 1 and "#part" in run.stderr, run.stderr
    (site / "docs" / "b.md").rename(site / "docs" / "c.md")
    run = build(site, "moved")
    assert run.returncode == 1 and "b.md" in run.stderr, run.stderr

"""Fixtures for the site tests: the vendored mermaid installed (as `make serve` does) and built sites."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import vendor_assets  # lives in tools/ (on sys.path via pytest's pythonpath), next to the mkdocs hook

from study.diagrams import label

ROOT = Path(__file__).resolve().parents[2]

# A label with every character mermaid's grammar gives a meaning: escaped by the diagram generator, it must
# come out of the browser as the same text (positive control for the escaping of recorded names).
NASTY_LABEL = 'a "quote" <b>tag</b> #1 `tick` | pipe; semi [x] (y) {z}'

# Mermaid sources of the test-only pages. The real site gets no fake pages: these live in a copy of docs/.
GOOD_DIAGRAMS = (
    """# Diagram check

```mermaid
graph LR
  X[input] --> C[ColumnParallelLinear]
  C -->|all-reduce over NVLink| R[RowParallelLinear]
```

```mermaid
sequenceDiagram
  participant compute
  participant prefetch
  prefetch->>compute: all-gather of unit 1
```

```mermaid
flowchart LR
  A["""
    + label(NASTY_LABEL)
    + """] -->|"""
    + label(NASTY_LABEL)
    + """| B[b]
```
"""
)
GOOD_LABELS = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "all-reduce over NVLink",
    "all-gather of unit 1",
    NASTY_LABEL,
]
BROKEN_DIAGRAM = """# Broken diagram (negative control)

```mermaid
graph LR
  A[[[ --> -->
```
"""


def mkdocs_env() -> dict[str, str]:
    return {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


@pytest.fixture(scope="session")
def vendored_docs() -> Path:
    """The repo's docs/ with the pinned mermaid installed and verified (fetched once, then from the cache)."""
    docs = ROOT / "docs"
    try:
        vendor_assets.ensure(docs, vendor_assets.load_lock())
    except vendor_assets.AssetError as e:
        pytest.fail(f"cannot install the site's vendored assets: {e}", pytrace=False)
    return docs


@pytest.fixture(scope="session")
def built_site(vendored_docs, tmp_path_factory) -> Path:
    """The real site, built the way a user builds it: `mkdocs build --strict` from the repo root."""
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=mkdocs_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}{proc.stderr}"
    return site


@pytest.fixture(scope="session")
def diagram_site(vendored_docs, tmp_path_factory) -> Path:
    """The real mkdocs.yml over a copy of docs/ plus two test pages: good diagrams and a broken one."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    work = tmp_path_factory.mktemp("diagram-site")
    docs = work / "docs"
    shutil.copytree(vendored_docs, docs)
    (docs / "diagram-check.md").write_text(GOOD_DIAGRAMS)
    (docs / "broken-diagram.md").write_text(BROKEN_DIAGRAM)
    config = load_config(
        config_file=str(ROOT / "mkdocs.yml"), docs_dir=str(docs), site_dir=str(work / "site"), strict=True
    )
    config.nav += [{"Diagram check": "diagram-check.md"}, {"Broken diagram": "broken-diagram.md"}]
    build(config)
    return work / "site"

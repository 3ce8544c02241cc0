"""Committed data a branch can change (a trace's config or model name, a recording, a calibration) reaches
the built site as text: a `<script>` planted in any of them is never live on a page (issue 35: N6, N8, N9).
Traces, calibrations and recorded text reach templates through fences.page_text; recorded output shows in a
block fenced by fences.fence_for, longer than any backtick run it holds."""

from __future__ import annotations

import json
import re
import shutil

from mkdocs.commands.build import build
from mkdocs.config import load_config

from tests.site.conftest import ROOT

MARKERS = ("N6", "N8", "N9", "RUN", "CAL")  # where each is planted: _plant


def _script(marker: str) -> str:
    return f'<script>document.title="{marker}"</script>'


def _edit_json(path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _plant(notes) -> None:
    traces, runs = notes / "traces", notes / "runs"
    _edit_json(traces / "fsdp1_vs_fsdp2.json", lambda t: t["config"].update(num_attention_heads="3" + _script("N8")))
    _edit_json(
        traces / "moe_scale_mixtral_8x7b.json",
        lambda t: t["setup"]["model"].update(name="mixtral-8x7b" + _script("N9")),
    )
    _edit_json(notes / "calibrations" / "h200-bf16.json", lambda c: c.update(device="H200" + _script("CAL")))
    with (runs / "tp-2.txt").open("a") as f:  # a line of four backticks once closed the block around it
        f.write("````\n" + _script("N6") + "\n")
    with (runs / "dp-ddp-zero1-fsdp.txt").open("a") as f:  # read with run_text() to quote its numbers
        f.write(_script("RUN") + "\n")


def test_no_planted_script_is_live_in_the_built_site(vendored_docs, tmp_path, monkeypatch):
    project = tmp_path / "project"
    for part in ("reading_notes", "reference", "tests/reference", "tests/evidence", "tests/tools"):  # notes read
        shutil.copytree(ROOT / part, project / part)
    _plant(project / "reading_notes")
    docs, site = tmp_path / "docs", tmp_path / "site"
    shutil.copytree(vendored_docs, docs, ignore=shutil.ignore_patterns("notes"))
    monkeypatch.setenv("PIN_AND_CITE_PROJECT", str(project))
    build(load_config(config_file=str(ROOT / "mkdocs.yml"), docs_dir=str(docs), site_dir=str(site)))
    pages = {page: page.read_text() for page in site.rglob("*.html")}
    for marker in MARKERS:
        live = [p for p, html in pages.items() if re.search(f'<script>document.title=(&quot;|"){marker}', html)]
        shown = [p for p, html in pages.items() if re.search(f'script(&gt;|>)document.title=(&quot;|"){marker}', html)]
        assert live == [] and shown, (marker, live, shown)  # printed, as text only

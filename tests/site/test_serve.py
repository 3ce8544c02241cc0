"""`mkdocs serve` with the site's hooks: editing a reading-note template triggers a rebuild (live reload), and a
note that breaks (say after a `bump`) is one error line while the site goes on serving its previous page."""

from __future__ import annotations

import queue
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

from tests.gitserver import free_port
from tests.site.conftest import ROOT, mkdocs_env

# How long a build of the whole site may take before the test gives up: about 10 s on a quiet 2-core machine, several
# times that while the other test worker runs torchrun jobs beside it. A bound on waiting, not a timing assertion.
BUILD_WAIT_S = 120
# What `mkdocs serve` logs once a rebuild is done. Not "Documentation built in 0.27 seconds": mkdocs logs each
# message of its build logger once (utils.DuplicateFilter), so a rebuild as fast as an earlier one says nothing.
REBUILT = "Reloading browsers"


def _wait_for(lines: queue.Queue, text: str, timeout: float = BUILD_WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=deadline - time.monotonic())
        except queue.Empty:
            break
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"mkdocs serve never said {text!r}; it said:\n{''.join(seen)}")


def test_editing_a_note_template_rebuilds_the_served_site(vendored_docs, tmp_path):
    # A checkout-shaped folder: the real mkdocs.yml (hook path made absolute), docs/ and reading_notes/.
    config = (ROOT / "mkdocs.yml").read_text().replace("- tools/site_hooks.py", f"- {ROOT}/tools/site_hooks.py")
    (tmp_path / "mkdocs.yml").write_text(config)
    shutil.copytree(vendored_docs, tmp_path / "docs")
    shutil.copytree(
        ROOT / "reading_notes", tmp_path / "reading_notes", ignore=shutil.ignore_patterns("*.md.j2")
    )  # pins and lock, no notes
    template = tmp_path / "reading_notes" / "note.md.j2"
    template.write_text("---\nrules: none\n---\n# A note\n")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mkdocs", "serve", "--dev-addr", f"127.0.0.1:{port}"],
        cwd=tmp_path,
        env=mkdocs_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        _wait_for(lines, "Watching paths for changes: 'docs', 'mkdocs.yml', 'reading_notes'")
        _wait_for(lines, "Serving on http://127.0.0.1:")
        template.write_text("---\nrules: none\n---\n# A note, edited\n")
        _wait_for(lines, "Detected file changes")
        _wait_for(lines, "Building documentation")
        _wait_for(lines, REBUILT)
        assert (tmp_path / "docs" / "notes" / "note.md").read_text() == "---\nrules: none\n---\n# A note, edited\n"

        template.write_text("---\nrules: none\n---\n# A note, broken\n{% if %}\n")
        _wait_for(lines, "Detected file changes")
        _wait_for(lines, "reading_notes/note.md.j2:5: ")  # the one line naming the template's line
        _wait_for(lines, REBUILT)  # and the site is built around it, its page as it was
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/notes/note/", timeout=10).read().decode()
        assert "A note, edited" in page and "broken" not in page
        template.write_text("---\nrules: none\n---\n# A note, mended\n")
        mended = tmp_path / "docs" / "notes" / "note.md"
        deadline = time.monotonic() + BUILD_WAIT_S  # a rebuild from an earlier edit may still be queued: poll
        while mended.read_text() != "---\nrules: none\n---\n# A note, mended\n" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mended.read_text() == "---\nrules: none\n---\n# A note, mended\n"
    finally:
        proc.terminate()
        proc.wait(timeout=10)

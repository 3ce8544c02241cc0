"""Without a browser the test command still passes and says, in its summary, that the browser tests were skipped."""

import os
import subprocess
import sys

from tests.site.conftest import ROOT


def test_browser_tests_skip_with_a_clear_reason_without_chromium(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/site/test_browser.py",
            "-k",
            "every_link",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SITE_TEST_CHROMIUM": str(tmp_path / "no-chromium")},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"BROWSER TESTS SKIPPED: {tmp_path / 'no-chromium'} is missing" in proc.stdout  # -ra summary line
    assert "1 skipped" in proc.stdout

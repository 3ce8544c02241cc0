"""The citation tool never imports the reference or torch: `check` on the shipped notes loads neither (the
Scale page's tables read the committed traces instead)."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.tools.conftest import ROOT


def test_check_loads_neither_torch_nor_the_reference():
    """Run `check` on the shipped notes in a fresh interpreter and look at what it loaded."""
    probe = ("import sys, runpy\nsys.argv = ['pin_and_cite', 'check']\n"
             "try:\n    runpy.run_module('pin_and_cite', run_name='__main__')\nexcept SystemExit as e:\n"
             "    code = e.code\nelse:\n    code = 0\n"
             "print(code, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'reference'}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tools")}
    env.pop("PIN_AND_CITE_PROJECT", None)
    proc = subprocess.run([sys.executable, "-P", "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == "0 []", proc.stdout + proc.stderr

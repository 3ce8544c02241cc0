"""The xdist scopes (tests/conftest.py::scope_of) keep the tests that read one session-cached launch together."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import OWN_LAUNCHES, scope_of

REFERENCE = Path(__file__).resolve().parent / "reference"
SHARED_READERS = re.compile(r"\brun_worker\b")  # tests/launch.py SHARED launches


def test_a_reference_module_outside_the_shared_scope_reads_no_shared_launch():
    for name in sorted(OWN_LAUNCHES):
        assert (REFERENCE / name).is_file(), name
        assert not SHARED_READERS.search((REFERENCE / name).read_text()), name
        assert scope_of(f"tests/reference/{name}::test_x") == f"tests/reference/{name}"


def test_scopes():
    assert scope_of("tests/reference/test_tp_claims.py::test_a[tp2]") == "tests/reference"
    assert scope_of("tests/reference/test_bench_decoder.py::t") == scope_of("tests/reference/test_bench_distopt.py::t")
    assert scope_of("tests/site/test_browser.py::t") == scope_of("tests/site/test_build.py::t") == "tests/site"
    assert scope_of("tests/tools/test_defaults.py::t[up:pkg/f.py::C-x]") == "tests/tools/test_defaults.py"
    ranked = scope_of("tests/reference/test_recorder.py::test_a[2ranks-cpu]")  # @on_ranks tests: one scope
    assert ranked == scope_of("tests/test_ranks.py::test_b[x-4ranks-cuda]") != "tests/reference"

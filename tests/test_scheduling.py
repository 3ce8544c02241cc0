"""The xdist scopes (tests/conftest.py::scope_of): the tests that share launches or a build run in one worker."""

from __future__ import annotations

from tests.conftest import scope_of


def test_scopes():
    two = scope_of("tests/reference/test_recorder.py::test_a[2ranks-cpu]")  # @on_ranks tests: a scope a launch
    assert two == scope_of("tests/evidence/test_x.py::test_b[x-2ranks-cpu-y]") == "@on_ranks[2ranks-cpu]"
    assert scope_of("tests/test_ranks.py::test_b[x-4ranks-cuda]") == "@on_ranks[4ranks-cuda]"
    assert scope_of("tests/reference/test_pipeline.py::test_p[gpipe-8ranks-cpu]") == "@on_ranks[8ranks-cpu]"
    assert scope_of("tests/site/test_browser.py::t") == scope_of("tests/site/test_build.py::t") == "tests/site"
    assert scope_of("tests/reference/test_tp_bad_input.py::t") == "tests/reference/test_tp_bad_input.py"
    assert scope_of("tests/reference/test_gpt_demo.py::t[--tp-x]") == "tests/reference/test_gpt_demo.py"
    assert scope_of("tests/tools/test_defaults.py::t[up:pkg/f.py::C-x]") == "tests/tools/test_defaults.py"

"""The @on_ranks harness (tests/ranks.py), run in a pytest of its own on a file of tiny bodies at 2 CPU ranks:
a pass, a failure on one rank only, a skip, a crash and a hang, each reported as such, and the tests after a
failure or a crash still run (in a new launch)."""

import re

import torch

from tests.launch import ROOT

CASES = """
import os

import pytest
import torch
import torch.distributed as dist

from tests.ranks import on_ranks


@on_ranks(2, timeout_s=3)
def test_passes(ranks):
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == ranks.world


@on_ranks(2, timeout_s=3)
def test_fails_on_rank_1(ranks):
    print(f"rank {ranks.rank} computed", 6 * 7)
    assert ranks.rank == 0, "only rank 0 may pass"


@on_ranks(2, timeout_s=3)
@pytest.mark.parametrize("value", [1, 2])
def test_passes_after_a_failure(ranks, value):
    assert value in (1, 2) and dist.get_world_size() == 2


@on_ranks(2, timeout_s=3)
def test_skips(ranks):
    pytest.skip("no such feature here")


@on_ranks(2, timeout_s=3)
def test_crashes(ranks):
    if ranks.rank == 1:
        print("rank 1 leaves", flush=True)
        os._exit(3)


@on_ranks(2, timeout_s=3)
def test_passes_after_a_crash(ranks):
    dist.barrier()


@on_ranks(2, timeout_s=3)
def test_hangs(ranks):
    if ranks.rank == 0:  # rank 1 never joins: rank 0's all-reduce times out after 3 s
        dist.all_reduce(torch.ones(1))


@on_ranks(2, devices=["cuda"], timeout_s=3)
def test_on_gpus(ranks):
    assert ranks.device.type == "cuda"
"""


def test_pass_fail_skip_crash_and_hang_are_reported_per_test(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makepyfile(test_cases=CASES)
    pytester.makeini("[pytest]\nmarkers = cuda: needs CUDA")
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider", "-rA")
    out = result.stdout.str()
    gpus = torch.cuda.device_count() >= 2
    result.assert_outcomes(passed=4 + gpus, failed=3, skipped=2 - gpus)
    for test in ["passes", "passes_after_a_failure[1-2ranks-cpu]", "passes_after_a_failure[2-2ranks-cpu]"]:
        assert f"PASSED test_cases.py::test_{test}" in out
    failure = section(out, "test_fails_on_rank_1[2ranks-cpu]")
    assert "=== rank 1 failed ===" in failure and "rank 0" not in failure.replace("only rank 0 may pass", "")
    assert "AssertionError: only rank 0 may pass" in failure and "rank 1 computed 42" in failure
    assert re.search(r"SKIPPED .*: rank 0: no such feature here", out)
    crash = section(out, "test_crashes[2ranks-cpu]")
    assert "the launch died in this test" in crash and "exited" in crash and "rank 1 leaves" in crash
    assert "PASSED test_cases.py::test_passes_after_a_crash[2ranks-cpu]" in out
    hang = section(out, "test_hangs[2ranks-cpu]")
    assert "=== rank 0 failed ===" in hang and "=== rank 1" not in hang and "timed out" not in hang
    assert "a peer never joined this collective within @on_ranks(timeout_s=3)" in hang
    if not gpus:
        assert re.search(r"SKIPPED .*needs 2 CUDA device\(s\), one per rank, found \d", out)


def section(out: str, test: str) -> str:
    """The failure report of `test` in pytest's output."""
    start = out.index(f"_ {test} _") + len(test) + 2
    return out[start:][: re.search(r"\n(_{5}|={5,} \w)", out[start:]).start()]


BUDGET_CASES = """
import os

from tests.ranks import on_ranks


@on_ranks(2)
@pytest.mark.parametrize("index", [0, 1, 2])
def test_records_its_launch(ranks, index):
    with open(os.path.join(os.environ["LAUNCHES"], f"{index}.rank{ranks.rank}"), "w") as f:
        f.write(str(os.getpid()))
"""


def test_a_launch_past_its_budget_starts_no_more_tests(pytester, monkeypatch, tmp_path):
    """With no budget, each test gets a launch of its own (no test starts after the budget), and all pass."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("LAUNCHES", str(tmp_path))
    pytester.makepyfile(test_budget="import pytest\n" + BUDGET_CASES)
    pytester.makeconftest("import tests.ranks\n\ntests.ranks.LAUNCH_BUDGET_S = 0\n")
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    pids = {(tmp_path / f"{index}.rank0").read_text() for index in range(3)}
    assert len(pids) == 3, "each test ran in a launch of its own"

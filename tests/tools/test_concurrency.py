"""Several pin-and-cite runs at once share one cache and one project: they take turns where they must and
all succeed (the cache's per-remote lock around partial-repository creation and every fetch into it; the
project lock around a bump)."""

import json

import pytest

from tests.tools.test_bump import noted, snapshot  # noqa: F401  (noted: a fixture pytest finds by name)
from tests.tools.test_relocate_cli import EXPECTED, relocate_popen

RUNS = 8


def test_concurrent_relocates_on_a_cold_cache_all_succeed(history, tmp_path):
    """Full SHAs: each run fetches the commits itself (a tag is first looked up with ls-remote)."""
    cache = tmp_path / "cache"  # cold: no partial repository yet, all runs create it at once
    procs = [
        relocate_popen(
            history.url, "--from", history.c1, "--to", history.c2, "--json", *[c for c, _, _ in EXPECTED], cache=cache
        )
        for _ in range(RUNS)
    ]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [(code, err) for code, _, err in results] == [(0, "")] * RUNS
    for _, out, _ in results:
        assert [(a["cite"], a["status"], a["lines"]) for a in json.loads(out)] == EXPECTED


def _recorded_changes(project) -> dict:
    return json.loads(project.lock_path.read_text())["bumps"]["up"]["changes"]


@pytest.mark.usefixtures("noted")
def test_a_repeated_bump_is_a_no_op_that_keeps_the_record(project, history):
    assert project.run("bump", "up", "--ref", "c2").code == 0
    recorded = _recorded_changes(project)
    assert len(recorded) == 3
    before = snapshot(project)
    r = project.run("bump", "up", "--ref", history.c2)
    assert (r.code, r.out, r.err) == (
        0,
        f"up is already pinned at {history.c2[:12]} ({history.c2}); nothing to bump\n",
        "",
    )
    assert snapshot(project) == before


@pytest.mark.usefixtures("noted")
def test_two_bumps_at_once_take_turns_and_one_record_survives(project, history):
    procs = [project.popen("bump", "up", "--ref", "c2") for _ in range(2)]
    results = sorted((p.wait(timeout=120), *p.communicate()) for p in procs)
    assert [code for code, _, _ in results] == [0, 0]
    assert sum("nothing to bump" in out for _, out, _ in results) == 1
    assert len(_recorded_changes(project)) == 3
    assert f'commit = "{history.c2}"' in project.pins_path.read_text()

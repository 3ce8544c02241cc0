"""Several pin-and-cite runs at once share one cache and one project: they take turns where they must and
all succeed (the cache's per-remote lock around partial-repository creation and every fetch into it; the
project lock around a bump)."""
import json
import subprocess

from tests.tools.test_relocate_cli import EXPECTED, relocate_popen

RUNS = 8


def test_concurrent_relocates_on_a_cold_cache_all_succeed(history, tmp_path):
    """Full SHAs: each run fetches the commits itself (a tag is first looked up with ls-remote)."""
    cache = tmp_path / "cache"                 # cold: no partial repository yet, all runs create it at once
    procs = [relocate_popen(history.url, "--from", history.c1, "--to", history.c2, "--json", *[c for c, _, _ in EXPECTED],
                            cache=cache) for _ in range(RUNS)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [(code, err) for code, _, err in results] == [(0, "")] * RUNS
    for _, out, _ in results:
        assert [(a["cite"], a["status"], a["lines"]) for a in json.loads(out)] == EXPECTED

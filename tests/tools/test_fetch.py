"""fetch: exactly the cited objects cross the wire, every byte is verified, interruptions leave nothing half-written."""

import json
import os
import signal
import time

import git

from tests.gitserver import ByteCountingProxy

CITES = ["up:pkg/core/layers.py#L9-L10", "up:pkg/core/mappings.py::region_3"]


def locked(project, upstream):
    """Cite through the daemon, then forget the cache: the lock alone now drives fetch."""
    r = project.run("cite", *CITES)
    assert r.code == 0, r.err
    import shutil

    shutil.rmtree(project.cache)


def partial_repo_objects(project) -> set[str]:
    [git_dir] = [d for d in (project.cache / "git").iterdir() if d.is_dir()]  # not its .lock
    out = git.Repo(git_dir).git.execute(["git", "cat-file", "--batch-all-objects", "--batch-check"])
    return {line.split()[0]: line.split()[1] for line in out.splitlines()}


def test_fetch_with_lock_transfers_only_the_cited_blobs(project, upstream, daemon):
    locked(project, upstream)
    proxy = ByteCountingProxy(daemon.port)
    r = project.run("fetch", "--json", "--url", f"up={daemon.url('upstream.git', proxy.port)}")
    assert r.code == 0, r.err
    blobs = {f["blob"] for f in r.json()}
    assert {f["origin"] for f in r.json()} == {daemon.url("upstream.git", proxy.port)}
    assert set(partial_repo_objects(project)) == blobs  # not a commit, not a tree more
    cited_size = sum(len(upstream.files[p]) for p in ("pkg/core/layers.py", "pkg/core/mappings.py"))
    assert proxy.sent_to_client < cited_size + 2_000  # 4 MB of other files never moved
    assert "[2/2]" in r.err  # progress


def test_first_cite_walks_only_the_trees_on_the_cited_path(project, upstream):
    assert project.run("cite", CITES[0]).code == 0
    objects = partial_repo_objects(project)
    kinds = sorted(objects.values())
    assert kinds == ["blob", "commit", "tree", "tree", "tree"]  # commit, /, pkg/, pkg/core/, layers.py


def test_fetch_prefers_the_cache_and_refetches_a_corrupt_entry(project, upstream):
    locked(project, upstream)
    assert project.run("fetch").code == 0
    blob = json.loads(project.lock_path.read_text())["files"]["up:pkg/core/layers.py"]["blob"]
    cached = project.cache / "blobs" / blob[:2] / blob[2:]
    assert project.run("fetch", "--json").json()[0]["origin"] == "cache"
    cached.write_bytes(b"tampered")
    r = project.run("fetch", "--json")
    assert r.code == 0, r.err
    origins = {f["path"]: f["origin"] for f in r.json()}
    assert origins["pkg/core/layers.py"] == upstream.url  # tampered copy never used
    assert cached.read_bytes() == upstream.files["pkg/core/layers.py"]


def test_interrupted_fetch_leaves_no_partial_file_and_next_run_recovers(project, upstream, daemon):
    locked(project, upstream)
    proxy = ByteCountingProxy(daemon.port, stall_after=400)  # the pack stops mid-way
    proc = project.popen("fetch", "--url", f"up={daemon.url('upstream.git', proxy.port)}")
    assert proxy.stalled.wait(20)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole process group
    proc.wait(60)  # two busy cores: the test's own process may wait its turn
    assert proc.returncode != 0
    blobs_dir = project.cache / "blobs"
    assert not blobs_dir.exists() or not any(p.is_file() for p in blobs_dir.rglob("*"))
    r = project.run("fetch", "--json")
    assert r.code == 0, r.err
    assert len(r.json()) == 2


def test_two_fetches_at_once_share_the_cache_safely(project, upstream):
    locked(project, upstream)
    procs = [project.popen("fetch", "--json") for _ in range(2)]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert project.run("check").code == 0
    origins = sorted(f["origin"] for out, _ in results for f in json.loads(out))
    assert origins.count("cache") >= 2  # the second waited, then reused


def test_check_needs_no_network_once_fetched(project, upstream):
    locked(project, upstream)
    assert project.run("fetch").code == 0
    project.write_pins(up={"url": "git://127.0.0.1:9/nothing-here", "commit": upstream.v1})
    assert project.run("check").code == 0

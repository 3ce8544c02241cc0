"""Bytes on the wire and wall time: `pin-and-cite` fetch of a few cited files vs a full `git clone`.

One run, one local `git daemon`, every byte counted by a TCP proxy in front of it (not by what lands on
disk). The upstream is a real-sized tree: the installed torch package's sources (.py/.pyi/.h) committed at
their repository paths in two commits. The physical limit is the compressed size of the cited blobs
themselves (a pack holding just them). Also times `check` on the shipped citations and on 5,000 synthetic
ones, warm.

    .venv/bin/python benchmarks/fetch_vs_clone.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import git
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from pin_and_cite.check import check
from pin_and_cite.core.citation import parse_spec
from pin_and_cite.core.project import Project
from pin_and_cite.core.resolve import Resolver
from tests.gitserver import ByteCountingProxy, GitDaemon

CITED = [
    "torch/distributed/fsdp/_runtime_utils.py",
    "torch/distributed/fsdp/_flat_param.py",
    "torch/distributed/tensor/parallel/style.py",
]


def build_upstream(base: Path) -> str:
    """A bare repo of torch's sources at their repo paths; returns the head commit."""
    site = Path(torch.__file__).parent.parent
    work = git.Repo.init(base / "work")
    files = [p for p in (site / "torch").rglob("*") if p.suffix in {".py", ".pyi", ".h"} and p.is_file()]
    for src in files:
        dst = base / "work" / src.relative_to(site)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    work.git.add("-A")
    work.git.commit("-qm", "import", "--author", "bench <b@b>")
    random.Random(0).shuffle(files)
    for src in files[:200]:  # a second commit: some history
        with open(base / "work" / src.relative_to(site), "a") as f:
            f.write("\n# touched\n")
    work.git.commit("-qam", "touch", "--author", "bench <b@b>")
    work.clone(base / "served" / "torch.git", bare=True)
    return work.head.commit.hexsha


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def cli(project: Path, cache: Path, *args: str) -> None:
    subprocess.run(
        [str(ROOT / "tools" / "pin-and-cite"), *args, "--project", str(project)],
        check=True,
        capture_output=True,
        env={**os.environ, "PIN_AND_CITE_CACHE": str(cache)},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="fetch-bench-"))
    try:
        print("building the upstream repository from torch's sources ...", file=sys.stderr)
        commit = build_upstream(base)
        daemon = GitDaemon(base / "served")
        proxy = ByteCountingProxy(daemon.port)
        url = daemon.url("torch.git", proxy.port)
        served = git.Repo(base / "served" / "torch.git")
        blobs = [served.git.rev_parse(f"{commit}:{p}") for p in CITED]
        pack = subprocess.run(
            ["git", "pack-objects", "--stdout"],
            cwd=served.git_dir,
            capture_output=True,
            input="\n".join(blobs).encode(),
            check=True,
        ).stdout
        limit = len(pack)

        proxy.reset()
        _, clone_s = timed(
            lambda: subprocess.run(["git", "clone", "-q", "--bare", url, str(base / "clone")], check=True)
        )
        clone_bytes = proxy.sent_to_client + proxy.sent_to_server

        project = base / "project"
        (project / "reading_notes").mkdir(parents=True)
        (project / "reading_notes" / "pins.toml").write_text(f'[sources.torch]\nurl = "{url}"\ncommit = "{commit}"\n')
        specs = [f"torch:{p}#L1-L20" for p in CITED]
        proxy.reset()
        _, first_s = timed(lambda: cli(project, base / "cache1", "cite", *specs))
        first_bytes = proxy.sent_to_client + proxy.sent_to_server
        proxy.reset()
        _, locked_s = timed(lambda: cli(project, base / "cache2", "fetch"))
        locked_bytes = proxy.sent_to_client + proxy.sent_to_server

        cli(ROOT, base / "cache3", "fetch")  # shipped: from the installed wheels
        check(Project(ROOT, cache_dir=base / "cache3"))
        shipped_report, shipped_s = timed(lambda: check(Project(ROOT, cache_dir=base / "cache3")))

        synthetic = Project(project, cache_dir=base / "cache2")
        resolver = Resolver(synthetic)
        rng = random.Random(1)
        i = 0
        while len(synthetic.lock.citations) < 5000:
            path, i = CITED[i % len(CITED)], i + 1
            n = len(resolver.lines_of("torch", path, synthetic.lock.files[f"torch:{path}"].blob))
            a = rng.randint(1, n - 30)
            excerpt, learned = resolver.resolve(parse_spec(f"torch:{path}#L{a}-L{a + rng.randint(0, 29)}"))
            resolver.record(excerpt, learned)
        synthetic.lock.save()
        check(Project(project, cache_dir=base / "cache2"))  # warm the OS cache
        report5k, check5k_s = timed(lambda: check(Project(project, cache_dir=base / "cache2")))
        assert not report5k.problems and not shipped_report.problems

        figures = {
            "cited_files": len(CITED),
            "cited_blobs_pack_bytes": limit,
            "full_clone_bytes": clone_bytes,
            "full_clone_s": round(clone_s, 3),
            "first_pin_bytes": first_bytes,
            "first_pin_s": round(first_s, 3),
            "first_pin_over_limit": round(first_bytes / limit, 2),
            "locked_fetch_bytes": locked_bytes,
            "locked_fetch_s": round(locked_s, 3),
            "locked_fetch_over_limit": round(locked_bytes / limit, 2),
            "clone_over_locked_fetch": round(clone_bytes / locked_bytes, 1),
            "check_shipped_citations": shipped_report.checked,
            "check_shipped_s": round(shipped_s, 4),
            "check_5000_citations": report5k.checked,
            "check_5000_s": round(check5k_s, 3),
        }
        daemon.stop()
        if args.json:
            print(json.dumps(figures, indent=2))
        else:
            for key, value in figures.items():
                print(f"{key:28} {value}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

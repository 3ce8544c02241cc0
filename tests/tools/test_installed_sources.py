"""The shipped pins and lock, proven against the installed torch 2.13.0 and megatron-core 0.16.1 wheels."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from pin_and_cite.core.gitobj import blob_sha

ROOT = Path(__file__).resolve().parents[2]
LOCK = json.loads((ROOT / "reading_notes" / "citations.lock").read_text())


def run(*args: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "tools" / "pin-and-cite"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PIN_AND_CITE_CACHE": str(cache)},
        timeout=120,
    )


@pytest.mark.parametrize(
    "module, key",
    [
        ("torch", "pytorch:torch/distributed/fsdp/_runtime_utils.py"),
        ("megatron.core", "megatron-lm:megatron/core/tensor_parallel/layers.py"),
    ],
)
def test_installed_wheel_has_the_locked_blob(module, key):
    package = __import__(module, fromlist=["_"])
    site = Path(package.__file__).parents[module.count(".") + 1]
    path = key.split(":", 1)[1]
    assert blob_sha((site / path).read_bytes()) == LOCK["files"][key]["blob"]


def test_torch_is_the_pinned_pytorch_commit():
    import torch

    pins = (ROOT / "reading_notes" / "pins.toml").read_text()
    assert f'commit = "{torch.version.git_version}"' in pins


def test_shipped_citations_fetch_offline_from_wheels_and_check(tmp_path):
    r = run("fetch", "--json", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    origins = {f["path"]: f["origin"] for f in json.loads(r.stdout)}
    assert set(origins) == {key.split(":", 1)[1] for key in LOCK["files"]}
    assert all(origin.startswith("distribution ") for origin in origins.values())
    r = run("check", "--json", cache=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    claims = sum(text.count("verified_by(") for text in map(Path.read_text, (ROOT / "reading_notes").rglob("*.md.j2")))
    defaults = len(LOCK.get("defaults", {}))
    assert report == {"checked": len(LOCK["citations"]) + defaults + claims, "broken": 0, "problems": []}

"""tools/vendor-assets against a real npm client and a local npm registry on 127.0.0.1 (no network).

The registry serves a small stand-in "mermaid" package whose tarball the test builds, so every path runs
for real: npm pack downloads it, the pinned integrity is checked, the cache is filled and reused.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from tests.gitserver import free_port
from tests.site.conftest import ROOT, vendor_assets

SCRIPT = "globalThis.mermaid = {initialize() {}, render() {}};\n"
DEST = "assets/vendor/mermaid/mermaid.min.js"


def _tarball(script: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in [
            ("package/package.json", '{"name": "mermaid", "version": "11.17.2"}'),
            ("package/dist/mermaid.min.js", script),
        ]:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _Registry(http.server.BaseHTTPRequestHandler):
    """The two documents `npm pack mermaid@11.17.2` asks a registry for: the packument and the tarball."""

    def do_GET(self):
        tarball, hits = self.server.tarball, self.server.hits
        hits.append(self.path)
        if self.path.endswith(".tgz"):
            body, kind = tarball, "application/octet-stream"
        elif self.path.rstrip("/") == "/mermaid":
            host, port = self.server.server_address
            dist = {
                "tarball": f"http://{host}:{port}/mermaid/-/mermaid-11.17.2.tgz",
                "integrity": vendor_assets.sri_sha512(tarball),
            }
            body = json.dumps(
                {
                    "name": "mermaid",
                    "dist-tags": {"latest": "11.17.2"},
                    "versions": {"11.17.2": {"name": "mermaid", "version": "11.17.2", "dist": dist}},
                }
            ).encode()
            kind = "application/json"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def registry(monkeypatch, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    server.tarball, server.hits = _tarball(SCRIPT), []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("npm_config_registry", f"http://127.0.0.1:{server.server_address[1]}/")
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))  # npm's own cache: not the user's
    yield server
    server.shutdown()
    server.server_close()


def _lock(tmp_path: Path, tarball: bytes, script: str = SCRIPT) -> Path:
    path = tmp_path / "vendor-assets.lock"
    path.write_text(
        f'[mermaid]\npackage = "mermaid"\nversion = "11.17.2"\n'
        f'integrity = "{vendor_assets.sri_sha512(tarball)}"\nfile = "dist/mermaid.min.js"\n'
        f'file_sha512 = "{hashlib.sha512(script.encode()).hexdigest()}"\ndest = "{DEST}"\n'
    )
    return path


def _cli_error(tmp_path: Path, lock: Path) -> str:
    """Run the tool as users do; return its one error line, after checking it failed with nothing else to say."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "vendor_assets.py"),
            "--lock",
            str(lock),
            "--docs-dir",
            str(tmp_path / "docs"),
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc
    progress, error = proc.stderr.splitlines()
    assert progress == "vendor-assets: fetching mermaid@11.17.2 with npm pack (once; cached afterwards)"
    return error


def test_fetches_verifies_caches_then_works_offline(registry, tmp_path):
    docs, cache = tmp_path / "docs", tmp_path / "cache"
    assets = vendor_assets.load_lock(_lock(tmp_path, registry.tarball))
    vendor_assets.ensure(docs, assets, cache)
    installed = docs / DEST
    assert installed.read_text() == SCRIPT and installed.stat().st_mode & 0o777 == 0o644
    assert [p.read_bytes() for p in cache.glob("*.tgz")] == [registry.tarball]
    assert sum(hit.endswith(".tgz") for hit in registry.hits) == 1

    # Offline from here: no registry, and an npm that does not exist, so any fetch attempt would fail.
    registry.shutdown()
    installed.write_text("tampered")
    vendor_assets.ensure(docs, assets, cache, npm="/nonexistent/npm")  # reinstalled from the cache
    assert installed.read_text() == SCRIPT
    vendor_assets.ensure(docs, assets, tmp_path / "empty-cache", npm="/nonexistent/npm")  # verified: no work
    assert not (tmp_path / "empty-cache").exists()
    assert vendor_assets.problems(docs, assets) == []


def test_corrupt_cached_tarball_is_fetched_again(registry, tmp_path):
    docs, cache = tmp_path / "docs", tmp_path / "cache"
    assets = vendor_assets.load_lock(_lock(tmp_path, registry.tarball))
    vendor_assets.ensure(docs, assets, cache)
    (cached,) = cache.glob("*.tgz")
    cached.write_bytes(b"truncated")
    (docs / DEST).unlink()
    vendor_assets.ensure(docs, assets, cache)
    assert cached.read_bytes() == registry.tarball and (docs / DEST).read_text() == SCRIPT


def test_integrity_mismatch_is_refused_in_one_line(registry, tmp_path):
    lock = _lock(tmp_path, _tarball("// what the lock pinned\n"))
    error = _cli_error(tmp_path, lock)
    assert error.startswith("vendor-assets: error: integrity mismatch for mermaid@11.17.2: the lock pins sha512-")
    assert f"npm delivered {vendor_assets.sri_sha512(registry.tarball)}; refusing it" in error
    assert not (tmp_path / "docs").exists() and not list((tmp_path / "cache").glob("*.tgz"))


def test_extracted_file_must_match_its_pin(registry, tmp_path):
    lock = _lock(tmp_path, registry.tarball, script="// a different build\n")
    with pytest.raises(vendor_assets.AssetError, match="dist/mermaid.min.js has sha512 .*, the lock pins"):
        vendor_assets.ensure(tmp_path / "docs", vendor_assets.load_lock(lock), tmp_path / "cache")
    assert not (tmp_path / "docs").exists()


def test_unreachable_registry_fails_fast_in_one_line(monkeypatch, tmp_path):
    port = free_port()  # nothing listens on it
    monkeypatch.setenv("npm_config_registry", f"http://127.0.0.1:{port}/")
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))
    error = _cli_error(tmp_path, _lock(tmp_path, _tarball(SCRIPT)))
    assert error.startswith("vendor-assets: error: npm pack mermaid@11.17.2 failed (no network or registry?): ")
    assert f"connect ECONNREFUSED 127.0.0.1:{port}" in error
    assert not (tmp_path / "docs").exists()


def test_missing_npm_and_bad_lock_are_one_line_errors(tmp_path):
    assets = vendor_assets.load_lock(_lock(tmp_path, _tarball(SCRIPT)))
    with pytest.raises(vendor_assets.AssetError, match="'/nonexistent/npm' not found: install Node.js's npm"):
        vendor_assets.ensure(tmp_path / "docs", assets, tmp_path / "cache", npm="/nonexistent/npm")
    bad = tmp_path / "bad.lock"
    bad.write_text(
        '[x]\npackage = "x"\nversion = "1"\nintegrity = "sha512-AA=="\nfile = "f"\n'
        'file_sha512 = "00"\ndest = "../outside.js"\n'
    )
    with pytest.raises(vendor_assets.AssetError, match=r"dest '\.\./outside\.js' must stay inside the docs dir"):
        vendor_assets.load_lock(bad)

"""Install the study site's self-hosted front-end files (mermaid.js) from the npm registry, verified.

The site must work offline and load nothing from a CDN, yet mermaid is not committed. Each entry of
`tools/vendor-assets.lock` names one file inside one npm package tarball. The tarball is fetched with
`npm pack` (so the user's npm registry, proxy and mirror settings apply), checked against the pinned sha512
integrity before anything is read from it, and cached under the user cache dir, so later runs and other
checkouts need no network. The one file is then extracted, checked against its own pinned hash and moved
into the docs dir atomically. An installed file whose hash matches is left alone (no work, no network).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import platformdirs
from filelock import FileLock

from pin_and_cite.core.atomic import atomic_write

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "tools" / "vendor-assets.lock"
DOCS = ROOT / "docs"
CACHE = Path(platformdirs.user_cache_dir("tp-fsdp-study")) / "npm"
NPM_TIMEOUT_S = 300
# Few, short retries: an unreachable registry should fail in seconds, not after npm's minute of backoff.
NPM_FLAGS = [
    "--json",
    "--ignore-scripts",
    "--fetch-retries=1",
    "--fetch-retry-mintimeout=1000",
    "--fetch-retry-maxtimeout=3000",
]


class AssetError(Exception):
    """Why the assets cannot be installed, in one line for the user."""


@dataclass(frozen=True)
class Asset:
    name: str
    package: str
    version: str
    integrity: str
    file: str
    file_sha512: str
    dest: str

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"


def load_lock(path: Path = LOCK) -> list[Asset]:
    try:
        tables = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise AssetError(f"cannot read {path}: {e}") from None
    assets = []
    for name, fields in tables.items():
        try:
            asset = Asset(name=name, **fields)
        except TypeError as e:
            raise AssetError(f"{path}: [{name}]: {e}") from None
        dest = PurePosixPath(asset.dest)
        if dest.is_absolute() or ".." in dest.parts:
            raise AssetError(f"{path}: [{name}]: dest {asset.dest!r} must stay inside the docs dir")
        if not asset.integrity.startswith("sha512-"):
            raise AssetError(f"{path}: [{name}]: integrity must be a sha512 SRI string, got {asset.integrity!r}")
        assets.append(asset)
    return assets


def sri_sha512(data: bytes) -> str:
    """The npm registry's `dist.integrity` form of a hash (Subresource Integrity)."""
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def _file_sha512(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha512").hexdigest()
    except FileNotFoundError:
        return None


def problems(docs_dir: Path, assets: list[Asset]) -> list[str]:
    """One line per installed file that is missing or differs from the lock; empty when all verify."""
    found = []
    for asset in assets:
        dest = docs_dir / asset.dest
        digest = _file_sha512(dest)
        if digest is None:
            found.append(f"{dest} is missing ({asset.spec})")
        elif digest != asset.file_sha512:
            found.append(f"{dest} does not match the sha512 pinned for {asset.spec}")
    return found


def ensure(docs_dir: Path, assets: list[Asset], cache_dir: Path = CACHE, npm: str = "npm") -> None:
    """Make every locked file present and verified under `docs_dir`, fetching only what is missing."""
    for asset in assets:
        dest = docs_dir / asset.dest
        if _file_sha512(dest) == asset.file_sha512:
            continue
        data = _extract(asset, _cached_tarball(asset, cache_dir, npm))
        atomic_write(dest, data)
        print(f"vendor-assets: installed {asset.spec} {asset.file} -> {dest}", file=sys.stderr)


def _cached_tarball(asset: Asset, cache_dir: Path, npm: str) -> Path:
    """The verified tarball from the cache, fetched into it first if absent or corrupt."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(asset.integrity.encode()).hexdigest()[:16]
    path = cache_dir / f"{asset.package.lstrip('@').replace('/', '-')}-{asset.version}-{key}.tgz"
    with FileLock(f"{path}.lock", timeout=NPM_TIMEOUT_S):  # two builds at once share one download
        if path.is_file() and sri_sha512(path.read_bytes()) == asset.integrity:
            return path
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".fetch-") as tmp:
            tarball = _npm_pack(asset, Path(tmp), npm)
            got = sri_sha512(tarball.read_bytes())
            if got != asset.integrity:
                raise AssetError(
                    f"integrity mismatch for {asset.spec}: the lock pins {asset.integrity} but npm "
                    f"delivered {got}; refusing it (check your npm registry/proxy, or the lock)"
                )
            os.replace(tarball, path)
    return path


def _npm_pack(asset: Asset, out_dir: Path, npm: str) -> Path:
    print(f"vendor-assets: fetching {asset.spec} with npm pack (once; cached afterwards)", file=sys.stderr)
    cmd = [npm, "pack", asset.spec, "--pack-destination", str(out_dir), *NPM_FLAGS]
    try:
        proc = subprocess.run(cmd, cwd=out_dir, capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
    except FileNotFoundError:
        raise AssetError(
            f"{npm!r} not found: install Node.js's npm to fetch {asset.spec} once (it is cached afterwards)"
        ) from None
    except subprocess.TimeoutExpired:
        raise AssetError(f"npm pack {asset.spec} did not finish within {NPM_TIMEOUT_S}s") from None
    if proc.returncode != 0:
        raise AssetError(f"npm pack {asset.spec} failed (no network or registry?): {_npm_reason(proc)}")
    tarballs = list(out_dir.glob("*.tgz"))
    if len(tarballs) != 1:
        raise AssetError(f"npm pack {asset.spec} produced {len(tarballs)} tarballs, expected one")
    return tarballs[0]


def _npm_reason(proc: subprocess.CompletedProcess) -> str:
    """npm's one-line summary of a failure (its --json error object), else its last stderr line."""
    try:
        return json.loads(proc.stdout)["error"]["summary"]
    except (ValueError, KeyError, TypeError):
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else f"exit status {proc.returncode}"


def _extract(asset: Asset, tarball: Path) -> bytes:
    """The locked file's bytes from the package tarball (whatever its top folder is called)."""
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar:
            if member.isfile() and member.name.split("/", 1)[-1] == asset.file:
                data = tar.extractfile(member).read()
                break
        else:
            raise AssetError(f"{asset.spec} has no file {asset.file}")
    got = hashlib.sha512(data).hexdigest()
    if got != asset.file_sha512:
        raise AssetError(f"{asset.spec} {asset.file} has sha512 {got}, the lock pins {asset.file_sha512}")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vendor-assets", description=__doc__.splitlines()[0])
    parser.add_argument("--docs-dir", type=Path, default=DOCS, help="mkdocs docs_dir to install into")
    parser.add_argument("--cache-dir", type=Path, default=CACHE, help=f"tarball cache (default {CACHE})")
    parser.add_argument("--lock", type=Path, default=LOCK, help="the pins (default tools/vendor-assets.lock)")
    parser.add_argument("--check", action="store_true", help="only verify the installed files; never fetch")
    args = parser.parse_args(argv)
    try:
        assets = load_lock(args.lock)
        if args.check:
            found = problems(args.docs_dir, assets)
            for line in found:
                print(f"vendor-assets: {line}", file=sys.stderr)
            return 1 if found else 0
        ensure(args.docs_dir, assets, args.cache_dir)
    except AssetError as e:
        print(f"vendor-assets: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
